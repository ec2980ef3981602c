"""An example of a user's own echo2 task (``tasks.py``) and reward function (``rewards.py``)."""
