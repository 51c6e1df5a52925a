"""CPD services, one package and one process each (``python -m services.<name>``)."""
