"""Echo app for the tests of :mod:`contrafl.flower.launch`."""
