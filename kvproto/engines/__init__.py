"""The engines' way in: prefix identity and namespaces (:mod:`.prefix`), the
Mooncake-compatible store API (:mod:`.mooncake`, with a ``PYTHONPATH`` shim in
``shim/``), the LMCache remote-storage plug-in (:mod:`.lmcache`) and the SGLang
HiCache storage back end (:mod:`.sglang`). See ``docs/engines.md``."""
