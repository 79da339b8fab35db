"""Pure data loaders: tables (tabular.py) and caption sets (captions.py)."""
