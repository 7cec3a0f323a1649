"""The coordinator's command line (`halo-master`, halo/cli/master.py)."""
