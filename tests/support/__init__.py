"""Helpers the tests share (models, spawned process groups, reference kernels, event readers):
imported as ``support.<module>``; no test file imports another test file."""
