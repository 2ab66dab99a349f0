"""Pure, sans-IO protocol state machines, one module per spec in ``spec/``.

:data:`BINDINGS` maps each TLA+ module name to the binding that the
conformance test and the docs checker use. It is built on first use, so that
a process that imports one machine does not import them all.
"""

_MODULES = ("publish", "timeout", "lease", "failover", "directwrite", "handoff",
            "tenancy_system", "repair")


def __getattr__(name: str):
    if name != "BINDINGS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    bindings = {}
    for module in _MODULES:
        binding = importlib.import_module(f"{__name__}.{module}").BINDING
        bindings[binding.module] = binding
    globals()["BINDINGS"] = bindings
    return bindings
