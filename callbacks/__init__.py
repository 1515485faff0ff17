"""Training-health callbacks, installed as ``lit_cancel.callbacks``; they import nothing from ``lit_cancel``."""
