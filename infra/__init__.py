"""Not code: this folder's files (prices/, profiles/, skypilot/, iam/) are installed with echo2 as the
package ``echo2._infra`` (setup.py), which ``echo2.shipped`` reads with importlib.resources. The
marker makes it a regular package, which an editable install can map onto this folder."""
