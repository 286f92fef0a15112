"""Small runnable demonstrations (``python -m geosharp.demos.<name>``)."""
