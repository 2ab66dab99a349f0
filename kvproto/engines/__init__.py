"""The engines' way in: prefix identity and namespaces (:mod:`.prefix`), chunk
objects and the one place each direction moves them (:mod:`.chunks`), the
Mooncake-compatible store API (:mod:`.mooncake`, with a ``PYTHONPATH`` shim in
``shim/``), the LMCache remote-storage plug-in (:mod:`.lmcache`), the SGLang
HiCache storage back end (:mod:`.sglang`), the vLLM v1 KV connector
(:mod:`.vllm`), a transformers model's prefix cache (:mod:`.hf`) and the
prefill -> decode hand-off (:mod:`.handoff`). See ``docs/engines.md``."""
