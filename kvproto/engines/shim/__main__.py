"""Print the directory to put on PYTHONPATH to run Mooncake code on kvproto."""

from kvproto.engines.shim import PATH

print(PATH)
