"""Experiments: one-off validation runs of nanoflash, each a folder with its scripts, task, recipe, tests, raw
data and write-up. The package never imports them (tests/test_layers.py keeps it so)."""
