"""Constrained decoding through real stages: the gateway's matcher masks the rows the last
stage samples (JSON schemas, any JSON object, grammars), alone, batched and speculative."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from protos.sampling import SamplingParams
from server.api.tools import HERMES
from server.engine.constraint_spec import ToolSchema
from server.engine.constraints import (
    Constraint,
    Grammars,
    json_schema_constraint,
    tool_call_constraint,
)
from server.engine.loop import Engine, GenerationRequest
from server.engine.scheduler import SchedulerConfig
from server.engine.speculative import DraftProposer, Proposer
from server.metrics import GatewayMetrics
from server.ring.grpc_client import PipelineClient
from testing_support.tiny_models import CORPUS, JSON_CORPUS
from tests.clients import SCHEMA
from tests.conftest import EXACT
from tests.fleets import export_chat_model
from tests.processes import start_stages

PROMPTS = [[5, 17, 33, 99, 100, 7, 42, 8], [60, 61, 62], [9, 9, 9, 9, 9, 9], [18, 180, 81]]


@dataclass
class Ring:
    export: Path
    addresses: list[str]
    grammars: Grammars


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ring]:
    """A tiny qwen2 whose tokenizer can write JSON, on 2 paged stages, with its draft."""
    from transformers import PreTrainedTokenizerFast

    base = tmp_path_factory.mktemp("constraints")
    _, export = export_chat_model(base, name="model", chat_template=None, json=True, draft=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(export / "tokenizer"))
    # pools of 12 blocks of 32 positions, so constrained requests many at once are preempted
    # and re-prefilled
    from shard_runtime.paged import PagedRunner

    block = max(PagedRunner(export, i, EXACT, kv_cache_bytes=1).kv_cache_bytes for i in (0, 1))
    size = f"{12.5 * block / (1 << 30):.12f}"
    procs, addresses = start_stages(export, base, ["--kv-cache-size", size])
    try:
        from protos.manifest import load_manifest

        manifest = load_manifest(export)
        grammars = Grammars(tokenizer, manifest.model.vocab_size, manifest.tokenizer.eos_token_ids)
        yield Ring(export, addresses, grammars)
    finally:
        for proc in procs:
            proc.stop()


def generate(
    ring: Ring,
    constraint: Constraint | None,
    sampling: list[SamplingParams],
    prompts: list[list[int]],
    proposer: Proposer | None = None,
    concurrent: bool = True,
    max_tokens: int = 48,
    metrics: GatewayMetrics | None = None,
) -> list[list[int]]:
    eos = frozenset(ring.grammars._eos)

    async def run() -> list[list[int]]:
        client = PipelineClient(ring.addresses)
        await client.start()
        engine = Engine(
            client,
            eos,
            256,
            SchedulerConfig(prefill_chunk=4, max_prefill_in_flight=4, kv_pools=client.kv_pools),
            metrics,
            proposer=proposer,
            spec_k=3 if proposer else 0,
            grammars=ring.grammars,
        )

        async def one(i: int, prompt: list[int], params: SamplingParams) -> list[int]:
            request = GenerationRequest(f"r{i}", prompt, max_tokens, params, constraint=constraint)
            return [t.token_id async for t in engine.generate(request)]

        try:
            jobs = [one(i, p, s) for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))]
            if concurrent:
                return list(await asyncio.gather(*jobs))
            return [await job for job in jobs]
        finally:
            await engine.close()
            await client.close()

    return asyncio.run(run())


def text(ring: Ring, tokens: list[int]) -> str:
    eos = set(ring.grammars._eos)
    return str(ring.grammars._hf.decode([t for t in tokens if t not in eos]))


@pytest.mark.integration
def test_json_schema_output_validates_every_time_when_sampling(ring: Ring) -> None:
    """20 seeded requests at temperature 1, 4 at a time: every output parses and validates
    against the schema, and ends with the end-of-sequence token; unconstrained, they do not."""
    params = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(20)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(20)]
    constraint = json_schema_constraint(SCHEMA)
    outputs = generate(ring, constraint, params, prompts, max_tokens=64)
    for tokens in outputs:
        assert tokens[-1] in ring.grammars._eos, text(ring, tokens)
        jsonschema.validate(json.loads(text(ring, tokens)), SCHEMA)
    assert len({text(ring, t) for t in outputs}) > 10  # sampled, not one forced answer
    free = generate(ring, None, params[:8], prompts[:8], max_tokens=64)
    assert not any(_valid(text(ring, t)) for t in free)


def _valid(output: str) -> bool:
    try:
        jsonschema.validate(json.loads(output), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.mark.integration
def test_a_constraint_admitting_everything_changes_no_greedy_token(ring: Ring) -> None:
    """Greedy output under a grammar that admits any text (every token but the special ones)
    equals the output without a constraint."""
    import llguidance

    everything = Constraint(llguidance.LLMatcher.grammar_from_regex(r"(?s:.*)"), "regex")
    greedy = [SamplingParams()] * len(PROMPTS)
    free = generate(ring, None, greedy, PROMPTS, max_tokens=24)
    special = {0, 1}  # <unk>, <s>: no text, so no grammar over text admits them
    assert not any(special & set(t) for t in free)  # the comparison is fair
    assert generate(ring, everything, greedy, PROMPTS, max_tokens=24) == free


@pytest.mark.integration
def test_constrained_output_is_the_same_alone_batched_and_speculative(ring: Ring) -> None:
    """Four constrained requests (greedy and seeded sampling) together equal each alone, and
    so do 16 at once under preemption; with
    speculative decoding (the draft's proposals cut where the grammar refuses them) greedy
    and seeded sampled output is the same (a draft token is kept only where it is the token
    plain sampling picks)."""
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(),
        SamplingParams(temperature=0.9, seed=8),
    ]
    constraint = json_schema_constraint(SCHEMA)
    # prompts of 19-24 tokens: with the answer, every sequence outgrows its first KV block
    prompts = [[*p, *range(40, 56)] for p in PROMPTS]
    alone = generate(ring, constraint, params, prompts, concurrent=False)
    assert all(_valid(text(ring, t)) for t in alone)
    assert all(len(p) + len(t) > 33 for p, t in zip(prompts, alone, strict=True))
    assert generate(ring, constraint, params, prompts) == alone
    # 16 at once (each prompt 4 times) in pools of 12 blocks: admitted on their prompts' first
    # block, they fill the pools, and none ends without a second one, so some are preempted
    # and re-prefilled (the matcher stays in the gateway); every output is as alone
    busy = GatewayMetrics()
    together = generate(ring, constraint, params * 4, prompts * 4, metrics=busy)
    assert together == [*alone, *alone, *alone, *alone]
    assert busy.registry.get_sample_value("pipeshard_gateway_preemptions_total")
    proposer = DraftProposer(ring.export / "draft", EXACT, None)
    metrics = GatewayMetrics()
    speculative = generate(ring, constraint, params, prompts, proposer=proposer, metrics=metrics)
    assert metrics.registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
    assert speculative == alone


@pytest.mark.component  # trains a tokenizer and builds its grammar: seconds
def test_masks_of_draft_tokens_leave_the_matcher_where_it_was(tmp_path: Path) -> None:
    """Random walks: masks(draft) walks draft tokens (the end-of-sequence token among them)
    and forgets them; the matcher then gives the mask a fresh one gives at the same place, and
    takes any accepted part of the draft plus a token its mask allows."""
    import random

    from transformers import PreTrainedTokenizerFast

    from server.engine.constraints import _allows
    from testing_support.tiny_models import make_tokenizer

    make_tokenizer(tmp_path, corpus=CORPUS + JSON_CORPUS)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    eos = tokenizer.convert_tokens_to_ids("</s>")
    grammars = Grammars(tokenizer, len(tokenizer), [eos])
    constraint = tool_call_constraint(
        [ToolSchema("get_weather", SCHEMA)], HERMES.syntax, parallel=True, vocab=grammars.vocab()
    )
    rng = random.Random(0)

    def allowed(mask: bytes) -> list[int]:
        row = np.frombuffer(mask, dtype=np.int32)
        return [t for t in range(len(tokenizer)) if _allows(row, t)]

    for _ in range(40):
        matcher, taken = grammars.matcher(constraint), []
        for _ in range(40):
            shadow = grammars.matcher(constraint)
            shadow.advance(taken)
            draft: list[int] = []
            for _ in range(rng.randint(0, 4)):
                options = allowed(shadow.masks()[0][0])
                if eos in options and rng.random() < 0.5:
                    draft.append(eos)  # a draft that ends where the grammar may
                else:
                    draft.append(rng.choice(options) if rng.random() < 0.8 else rng.randrange(80))
                if draft[-1] not in options or draft[-1] == eos:
                    break
                shadow.advance(draft[-1:])
            masks, used = matcher.masks(draft)
            fresh = grammars.matcher(constraint)
            fresh.advance(taken)
            assert masks[0] == fresh.masks()[0][0]
            accepted = rng.randint(0, used)
            tokens = [*draft[:accepted], rng.choice(allowed(masks[accepted]))]
            if eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            matcher.advance(tokens)  # raises if the matcher lost its place
            taken += tokens
            if eos in tokens:
                break


@pytest.mark.component  # trains a tokenizer and builds its grammar: seconds
def test_forced_glm_calls_follow_glm_format_and_the_schemas(tmp_path: Path) -> None:
    """``tool_choice`` required for a GLM model: the grammar takes calls as GLM writes them
    (with GLM-4.5's newlines or without, GLM-4.7's), each argument's value held to its schema
    (strings as text within maxLength, the rest as JSON), and nothing else: not hermes' JSON,
    not an unknown argument, not a missing required one."""
    from transformers import PreTrainedTokenizerFast

    from server.api.tools import GLM
    from server.engine.constraints import ConstraintError
    from testing_support.tiny_models import make_tokenizer

    make_tokenizer(tmp_path, corpus=CORPUS + JSON_CORPUS)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    eos = tokenizer.convert_tokens_to_ids("</s>")
    grammars = Grammars(tokenizer, len(tokenizer), [eos])
    lookup = {"type": "object", "properties": {"query": {"type": "string"}}}
    tools = [ToolSchema("get_weather", SCHEMA), ToolSchema("lookup", lookup)]
    constraint = tool_call_constraint(tools, GLM.syntax, parallel=True, vocab=grammars.vocab())

    def accepted(text: str) -> bool:
        matcher = grammars.matcher(constraint)
        try:  # the text, then the end: refused unless the grammar is complete there
            matcher.advance([*tokenizer.encode(text, add_special_tokens=False), eos])
        except ConstraintError:
            return False
        return True

    weather = GLM.write_call("get_weather", {"city": "Paris", "days": 3, "ok": True})
    assert accepted(weather)
    assert accepted(weather + "\n" + GLM.write_call("lookup", {"query": "the fox"}))
    assert accepted(GLM.write_call("lookup", {}))  # query is optional
    compact = weather.replace("\n", "")
    assert accepted(compact)
    assert not accepted(weather.replace("Paris", "Paris is a long name"))  # maxLength 12
    assert not accepted(weather.replace(">3<", ">10<"))  # maximum 9
    assert not accepted(GLM.write_call("get_weather", {"city": "Paris", "days": 3}))  # no ok
    assert not accepted(GLM.write_call("lookup", {"query": "x", "other": "y"}))
    assert not accepted('<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>')
    assert not accepted(GLM.write_call("unknown", {}))
    # parallel_tool_calls false: after one call, only the end
    from server.engine.constraints import _allows

    single = tool_call_constraint(tools[1:], GLM.syntax, parallel=False, vocab=grammars.vocab())
    matcher = grammars.matcher(single)
    matcher.advance(tokenizer.encode(GLM.write_call("lookup", {}), add_special_tokens=False))
    row = np.frombuffer(matcher.masks()[0][0], dtype=np.int32)
    assert [t for t in range(len(tokenizer)) if _allows(row, t)] == [eos]
