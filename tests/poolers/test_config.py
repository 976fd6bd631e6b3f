"""Pooler configs save and load one way (sentence-transformers' ``Module``: ``config_keys``,
``get_config_dict``, ``save``, ``load``), every registered pooler and the attention head included,
and what a pooler can do is declared as data."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from embedpool.errors import InvalidError
from embedpool.poolers import REGISTRY, build_pooler
from embedpool.poolers.attention import AttentionHead, AttentionPooler, RoleHeads
from embedpool.poolers.base import Pooler

TEXTS = ["config round trips keep the vectors", "a second, somewhat longer input text to pool " * 3, ""]

#: Options that differ from every default, per registered pooler (a new pooler adds its row).
NON_DEFAULT = {
    "mean": {"include_special": False},
    "cls": {},
    "max": {},
    "landmark": {"g": 7},
    "cluster": {"pool_factor": 3.0, "protected": 2, "pool_queries": True, "window": True},
    "tokens": {"window": True},
    "attention": {"queries": 3},
    "fde": {"k_sim": 2, "dim_proj": 8, "reps": 3, "seed": 5, "final_dim": 16, "window": True},
    "layermean": {"layers": "all", "include_special": False},
    "maxpoolbert": {"layers": "last2"},
    "multilayer": {"queries": 2},
    "pooling": {"mode": "max+mean"},
    "glot": {},  # weights= only: trained heads round-trip in tests/poolers/test_research_poolers.py
    "attnstats": {},
    "reinpool": {},
    "splade": {"top_k": 7, "threshold": 0.5},
    "mixed": {"a": 0.25},  # trained heads of these four: tests/poolers/test_pooling_operators.py
    "gated": {},
    "gem": {"p": 3.0},
    "ggem": {},
    "softpool": {},
    "simpool": {},
}


def _trained_head(dim: int, seed: int = 0, roles: str = "shared", **kw) -> AttentionHead | RoleHeads:
    """A head with non-zero weights (so that it is not mean pooling), separate heads unlike."""
    torch.manual_seed(seed)
    head = (RoleHeads if roles == "separate" else AttentionHead)(dim, value_projection=True, **kw)
    with torch.no_grad():
        for m in head.modules():
            if isinstance(m, AttentionHead):
                m.score.weight.normal_(0, 0.5)
                m.value.weight.add_(0.01 * torch.randn(dim, dim))
    return head.eval()


_STATES: dict = {}


def _pooled(pooler: Pooler, encoder, role: str = "document") -> list[torch.Tensor]:
    """``pooler`` on the token states of TEXTS (encoded once per plan and role: the model is
    frozen, so two poolers compared on one plan see the very same states)."""
    key = (pooler.plan, role)
    if key not in _STATES:
        _STATES[key] = list(encoder.encode(TEXTS, pooler.plan, role=role, all_layers=True))
    out: list = [None] * len(TEXTS)
    for ids, states in _STATES[key]:
        pooled = pooler.pool_role(states, role)
        for j, i in enumerate(ids):
            out[i] = pooled[j]
    return out


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_every_registered_pooler_round_trips_its_config(tmp_path, encoder):
    assert set(NON_DEFAULT) == set(REGISTRY), "add the new pooler to NON_DEFAULT"
    for name, cls in REGISTRY.items():
        assert cls.config_keys == tuple(cls.options), name
        pooler = cls(**NON_DEFAULT[name])
        folder = pooler.save(tmp_path / name)
        saved = json.loads((folder / cls.config_file_name).read_text())
        assert saved == pooler.get_config_dict(), name
        again = cls.load(folder)
        assert type(again) is cls and again.get_config_dict() == pooler.get_config_dict(), name
        assert again.spec == pooler.spec and again.plan == pooler.plan, name
        assert again.multi_vector == pooler.multi_vector and again.role_aware == pooler.role_aware, name
        for role in ("query", "document"):
            if cls.sparse:  # splade refuses this model (no MLM head): tests/poolers/test_splade.py pools it
                break
            _assert_same(_pooled(again, encoder, role), _pooled(pooler, encoder, role))
        # the spec string gives the same pooler as the saved config
        assert build_pooler(pooler.spec).get_config_dict() == pooler.get_config_dict(), name


def test_defaults_from_an_empty_config_and_bad_configs_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    assert REGISTRY["landmark"].load(tmp_path / "empty").spec == "landmark"  # no config.json: defaults
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"g": "seven"}))
    with pytest.raises(InvalidError, match="not a valid int"):
        REGISTRY["landmark"].load(bad)
    (bad / "config.json").write_text(json.dumps({"pool_factor": 2}))
    with pytest.raises(InvalidError, match="no option 'pool_factor'"):
        REGISTRY["landmark"].load(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable config"):
        REGISTRY["mean"].load(bad)


def test_trained_attention_pooler_round_trips_with_its_head(tmp_path, encoder):
    dim = encoder.hidden_size
    for roles, head in (("shared", _trained_head(dim, queries=2)), ("separate", _trained_head(dim, 1, "separate"))):
        head.save(tmp_path / f"trained-{roles}", encoder=encoder.model_id, objective="infonce")
        pooler = build_pooler(f"attention:weights={tmp_path / f'trained-{roles}'}", model_id=encoder.model_id)
        assert pooler.roles == roles and pooler.role_aware == (roles == "separate")
        folder = pooler.save(tmp_path / f"saved-{roles}")
        assert json.loads((folder / "config.json").read_text()) == {"weights": ".", "queries": head.queries}
        again = AttentionPooler.load(folder)
        assert again.head_config == {**pooler.head_config}
        assert again.head.meta == {"objective": "infonce"}
        for role in ("query", "document"):
            _assert_same(_pooled(again, encoder, role), _pooled(pooler, encoder, role))
        # the saved folder is also a head folder for a spec (`attention:weights=DIR`)
        as_spec = build_pooler(f"attention:weights={folder}", model_id=encoder.model_id)
        _assert_same(_pooled(as_spec, encoder, "query"), _pooled(pooler, encoder, "query"))
        # and still refuses another encoder
        with pytest.raises(ValueError, match="trained on encoder"):
            build_pooler(f"attention:weights={folder}", model_id="some/other-model")


def test_head_folders_of_the_existing_format_still_load(tmp_path, encoder):
    """A head folder as `embedpool train-pooler` wrote it before this config protocol:
    head.json (with provenance keys) + head.safetensors; loadable as a head, as
    `attention:weights=DIR` and as an AttentionPooler folder."""
    dim = encoder.hidden_size
    ref = _trained_head(dim)
    folder = tmp_path / "legacy"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "head.safetensors"))
    (folder / "head.json").write_text(json.dumps({
        "dim": dim, "queries": 1, "value_projection": True, "heads": 1, "roles": "shared",
        "encoder": encoder.model_id, "objective": "cosent", "source": "stsb", "split": "train",
        "dev_split": None, "self_supervised": None, "seed": 0, "best_epoch": 3, "best_step": 40}))
    head = AttentionHead.load(folder / "head.safetensors")
    assert head.get_config_dict() == {"dim": dim, "queries": 1, "value_projection": True, "heads": 1,
                                      "roles": "shared", "encoder": encoder.model_id}
    assert head.meta["objective"] == "cosent" and head.meta["best_step"] == 40
    hidden, mask = torch.randn(2, 5, dim), torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(head(hidden, mask), ref(hidden, mask), atol=0, rtol=0)
    from_spec = build_pooler(f"attention:weights={folder}", model_id=encoder.model_id)
    from_folder = AttentionPooler.load(folder)
    assert from_folder.weights == str(folder)
    _assert_same(_pooled(from_folder, encoder), _pooled(from_spec, encoder))
    # saving the head again keeps its provenance in the same file format
    head.save(tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "head.json").read_text()) == json.loads((folder / "head.json").read_text())


def test_capabilities_are_declared_and_match_behaviour(encoder):
    """``role_aware`` is true exactly when queries and documents pool differently;
    ``binds_model`` exactly for the poolers that check the encoder; ``multi_vector`` a bool."""
    cases = [("mean", {}), ("cls", {}), ("max", {}), ("landmark", {}), ("tokens", {}),
             ("cluster", {}), ("cluster", {"pool_queries": True}), ("attention", {}), ("attention", {"queries": 2}),
             ("fde", {}), ("layermean", {}), ("maxpoolbert", {}), ("multilayer", {}), ("multilayer", {"queries": 2}),
             ("glot", {}), ("attnstats", {}), ("reinpool", {}), ("pooling", {"mode": "mean+lasttoken"}),
             ("mixed", {"a": 0.5}), ("gated", {}), ("gem", {"p": 3.0}), ("ggem", {}), ("softpool", {}), ("simpool", {})]
    assert {n for n, _ in cases} == set(REGISTRY) - {"splade"}  # splade refuses this model: test_splade.py
    for name, opts in cases:
        p = REGISTRY[name](**opts)
        assert isinstance(p.multi_vector, bool) and isinstance(p.role_aware, bool), name
        q, d = _pooled(p, encoder, "query"), _pooled(p, encoder, "document")
        # the prompt-free default model: the role changes nothing before pooling
        differs = any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(q, d))
        assert differs == p.role_aware, (name, opts)
        assert type(p).binds_model == (type(p).bind is not Pooler.bind), name
    assert REGISTRY["attention"](queries=2).multi_vector and not REGISTRY["attention"]().multi_vector
    assert REGISTRY["attention"].multi_vector is None  # decided per instance
