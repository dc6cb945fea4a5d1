"""Paper parity (issue 9): every launcher, resolved by OpenRLHF's real parser, carries the released value of every
setting in openrlhf_search/parity/reference.py or a documented reason; docs/parity.md is generated from it."""

import os
import re

import pytest

from openrlhf_search.parity import check, reference, report
from openrlhf_search.parity.reference import LAUNCHERS, Ref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def rows():
    return check.compare_all()


def test_every_launcher_matches_its_reference_or_documents_why(rows):
    bad = check.undocumented(rows)
    assert not bad, "\n".join(f"{r.launcher} ({r.setting_name}) {r.setting}: reference {r.reference!r} "
                              f"[{r.source}], ours {r.ours!r}" for r in bad)
    # every launcher under every setting it accepts was resolved and compared on many settings
    seen = {(r.launcher, r.setting_name) for r in rows}
    assert seen == {(n, s) for n, l in LAUNCHERS.items() for s in l.settings}
    for key in seen:
        assert sum(1 for r in rows if (r.launcher, r.setting_name) == key) >= 35, key


def _value(rows, launcher, name, setting_name="released"):
    found = [r for r in rows if r.launcher == launcher and r.setting == name and r.setting_name == setting_name]
    assert len(found) == 1, (launcher, name, found)
    return found[0]


def test_the_issue_items_are_fixed_not_just_documented(rows):
    """The settings issue 9 found wrong now match the released code (they must not drift into 'documented')."""
    grpo, ppo = "searchr1_grpo_qwen2.5-7b_base.sh", "searchr1_ppo_qwen2.5-7b_base.sh"
    expect = [
        (grpo, "train.batch_size", 256), (grpo, "rollout.top_p", 0.95), (ppo, "algo.kl.use_loss", False),
        (ppo, "algo.kl.estimator", "k1"), (grpo, "algo.kl.estimator", "k3"), (ppo, "train.max_steps", 1005),
        (ppo, "actor.lr_scheduler", "constant_with_warmup"), (ppo, "actor.lr_warmup_ratio", 0.285),
        (ppo, "critic.lr_warmup_ratio", 0.015), (ppo, "actor.entropy_coef", 0.001),
        (ppo, "actor.adam.betas", (0.9, 0.999)), (ppo, "actor.adam.weight_decay", 0.01),
        ("r1searcher_qwen7b_base_single.sh", "rollout.top_p", 0.95),
        ("r1searcher_qwen7b_base_single.sh", "search.max_new_tokens_per_turn", 512),
        ("r1searcher_qwen7b_base_single.sh", "actor.loss_agg_mode", "seq-mean-token-mean"),
        ("r1searcher_qwen7b_base_single.sh", "actor.lr_warmup_ratio", 0.0),
        ("r1searcher_llama8b_instruct_stage1.sh", "algo.advantage.estimator", "group_norm"),
        ("r1searcher_llama8b_instruct_stage1.sh", "train.batch_size", 60),
        ("r1searcher_llama8b_instruct_stage2.sh", "rollout.batch_size", 65),
    ]
    for launcher, name, value in expect:
        r = _value(rows, launcher, name)
        assert r.status == "match" and check.same(r.ours, value), (launcher, name, r)


def test_a_changed_value_is_caught():
    """The mutation the parity test exists for: a launcher value that moves away from the reference fails."""
    launcher = LAUNCHERS["searchr1_grpo_qwen2.5-3b_base.sh"]
    rows = check.compare_launcher(launcher, "released", extra_args=["--train.batch_size", "1280",
                                                                    "--actor.lr_warmup_ratio", "0.03"])
    bad = {r.setting for r in check.undocumented(rows)}
    assert bad == {"train.batch_size", "actor.lr_warmup_ratio"}


def test_a_difference_needs_a_reason(monkeypatch):
    launcher = LAUNCHERS["searchr1_ppo_qwen2.5-3b_base.sh"]
    key = ("searchr1", "behaviour.weight_decay_on_norms_and_biases", None)
    assert reference.documented_reason("searchr1", key[1], launcher.tags)
    monkeypatch.delitem(reference.DOCUMENTED, key)
    rows = check.compare_launcher(launcher, "released")
    assert [r.setting for r in check.undocumented(rows)] == ["behaviour.weight_decay_on_norms_and_biases"]


def test_paper_setting_overrides_only_where_the_sources_disagree():
    llama1 = LAUNCHERS["r1searcher_llama8b_instruct_stage1.sh"]
    released = {r.setting: r for r in reference.references_for(llama1, "released")}
    paper = {r.setting: r for r in reference.references_for(llama1, "paper")}
    assert set(released) == set(paper)
    changed = {k for k in paper if paper[k] != released[k]}
    assert changed == {"search.reward_scheme", "algo.advantage.estimator"}
    assert paper["search.reward_scheme"].value == "r1searcher_stage1"
    with pytest.raises(ValueError):
        reference.references_for(llama1, "nope")


def test_every_reference_cites_a_file_and_line():
    pattern = re.compile(r"^[\w./-]+\.(sh|py|yaml)(:\d+(-\d+)?(,\d+)*)?(, [\w./-]+\.(sh|py|yaml):\d+(-\d+)?(,\d+)*)*$")
    for paper, refs in reference.REFERENCES.items():
        for r in refs:
            assert pattern.match(r.source), (paper, r)
            # a line number unless the row records something the file does not set ("unset" / no eval / a module)
            if r.value is not None and not r.setting.startswith("search.protocol"):
                assert re.search(r":\d", r.source), (paper, r)
    for refs in reference.PAPER_OVERRIDES.values():
        assert all(r.source.startswith("arXiv") for r in refs)


def test_lookup_rejects_unknown_settings(rows):
    from openrlhf_search.cli import train as cli

    argv, retriever = check.launcher_argv("searchr1_ppo_qwen2.5-3b_base.sh")
    args, cfg = cli.parse_args(argv)
    with pytest.raises(KeyError):
        check.lookup("actor.adam.nope", args, cfg, retriever)
    with pytest.raises(KeyError):
        check.lookup("behaviour.nope", args, cfg, retriever)
    assert check.lookup("retriever.encoder", args, cfg, retriever) == "e5-base-v2"
    assert check.same((0.9, 0.999), [0.9, 0.999]) and not check.same(1, True) and not check.same(0.95, 1.0)


def test_docs_parity_md_is_generated_and_current(rows):
    with open(report.DOC_PATH, encoding="utf-8") as f:
        current = f.read()
    assert current == report.render(rows), "docs/parity.md is stale: python -m openrlhf_search.parity.report"
    assert "| `train.batch_size` | all | 256" in current  # one merged row for the 8 Search-R1 launchers
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert "docs/parity.md" in readme
