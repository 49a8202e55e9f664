"""Canary exposure (Carlini et al. 2019, "The Secret Sharer") in a region's trained
adapter: no DP and no de-identification, DP-SGD only, de-identification only, both.

The region's data is the ``eu`` demo corpus (a few of its chats signed with synthetic
identifiers; the region's scrubber gets the demo's dictionary of their names) plus
planted canaries: chat records whose assistant turn holds a secret, each canary
repeated ``k`` times (``--k``, one canary per format and k) by a user of its own. Two
kinds:

- identifier canaries, which de-identification should find: a mainland China mobile
  number, an e-mail address, a resident ID with a valid check character and a
  Luhn-valid card number (their random parts: 8 digits, 8 letters, a birth date and
  sequence number, 11 digits);
- secret sentences, which hold no identifier, so no scrubber finds them: four random
  words of a 64-word list after "The vault passphrase is" and three more like it.

After training, the model's log-likelihood of each canary's random part given its
prompt (the user turn through the chat template, then the assistant's words up to the
secret) is ranked among ``--candidates`` N fresh draws of the same format that were
never inserted: exposure = log2(N+1) - log2(rank), at most log2(N+1). A canary the
model knows nothing of has expected exposure log2(N+1) - log2((N+1)!)/(N+1), about
1.44 bits ("chance"); the ``untrained`` row measures it on the initial adapter. Also
in the JSON: each canary's rank and log-likelihood gap (its log-likelihood minus the
candidates' mean, nats). With de-identification the exposure is that of the ORIGINAL
secret (what would leak), not of its placeholder.

Each setting trains one region through fedciuic's own path (``Region.train_round``,
one round of ``--steps`` local steps from the same initial adapter, its own state
folder: tokenisation cache and privacy ledger) with the app's run config
(pyproject.toml) and these overrides: region ``eu``, one round, ``local-steps``,
``lora-rank`` 32 and ``lora-targets`` ``auto+mlp`` (with the app's r=8 on the
attention projections, 1,000 steps without DP left both kinds near chance, 1.8 and
1.3 bits mean; r=8 on auto+mlp, 2.1 and 2.0), and ``dp`` and ``deidentify`` on or
off. The rest is the app's: ``adapter-mode`` lora-sb, ``learning-rate`` 0.01, batch 8,
user-level DP-SGD at target epsilon 4 (delta 1e-5, secure noise: DP runs differ run
to run), de-identification of ``direct`` identifiers by placeholders, done by the
region's tokenisation cache on every text field. Eval loss is on the setting's own
held-out records.

    PYTHONPATH=. .venv/bin/python benchmarks/canary.py           # about 7 minutes, 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/canary.py --quick   # a smoke run, a minute

Prints the tables and writes ``benchmarks/results/canary.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import shutil
import string
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from report import Row, verdict  # scripts side by side

from fedciuic.config import NodeConfig, RunConfig
from fedciuic.data.demo import CHAT_FILE, write_demo_corpora
from fedciuic.data.demo_pii import DEMO_DICTIONARIES
from fedciuic.data.records import parse_record
from fedciuic.data.scrubbing import region_scrubber, scrub_record
from fedciuic.data.tokenized import bucket_of
from fedciuic.deid import cn_check_character, cn_resident_id_valid
from fedciuic.model import evaluate
from fedciuic.ops.runconfig import app_run_config
from fedciuic.region.trainer import Region

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results" / "canary.json"
REGION = "eu"
IDENTIFIER, SECRET = "identifier", "secret sentence"
KINDS = (IDENTIFIER, SECRET)

#: key: (name, dp, deidentify)
SETTINGS = {
    "none": ("no DP, no scrub", False, False),
    "dp": ("DP only", True, False),
    "scrub": ("scrub only", False, True),
    "dp+scrub": ("DP + scrub", True, True),
}
UNTRAINED = "untrained"

#: Five-letter words: four of them make a secret sentence's random part (64^4 = 2^24).
_WORD_LIST = (
    "amber acorn agate alder apple arrow aspen badge basil beach berry birch blade bloom "
    "brick brook cabin camel cedar chalk cider cliff cloud coral crane creek daisy delta "
    "eagle ember fable fjord flint frost gecko grape hazel heron honey ivory jewel koala "
    "lemon lilac maple marsh melon moose noble oasis olive otter pearl pecan piano plume "
    "quail raven river robin salad solar spice storm"
)
WORDS = tuple(_WORD_LIST.split())
assert len(WORDS) == 64 and all(len(w) == 5 for w in WORDS)


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def phone(rng: random.Random) -> str:
    """The 8 free digits of a +86 138 mobile number."""
    return f"{_digits(rng, 4)} {_digits(rng, 4)}"


def email(rng: random.Random) -> str:
    """An e-mail address's local part: 8 lower-case letters."""
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(8))


def cn_id(rng: random.Random) -> str:
    """A resident ID after its area code 110105: birth date, sequence, check character."""
    born = datetime.date(1950, 1, 1) + datetime.timedelta(days=rng.randrange(20_000))
    full = f"110105{born:%Y%m%d}{_digits(rng, 3)}"
    full += cn_check_character(full)
    assert cn_resident_id_valid(full)
    return full[6:]


def card(rng: random.Random) -> str:
    """A 4539 card number's last 12 digits: 11 random and the Luhn check digit."""
    body = "4539" + _digits(rng, 11)
    total = 0
    for i, d in enumerate(reversed(body)):  # the check digit will sit right of these
        x = int(d) * (2 if i % 2 == 0 else 1)
        total += x - 9 if x > 9 else x
    tail = body[4:] + str(-total % 10)
    return f"{tail[:4]} {tail[4:8]} {tail[8:]}"


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(4))


@dataclass(frozen=True)
class Format:
    """A canary's template: the user's question, and the assistant's answer around the
    secret (``lead`` + secret + ``tail``); ``draw`` makes a secret."""

    name: str
    kind: str
    question: str
    lead: str
    tail: str
    draw: Callable[[random.Random], str]


FORMATS = (
    Format(
        "phone",
        IDENTIFIER,
        "What phone number do you have on file for me?",
        "The phone number on file is +86 138 ",
        ".",
        phone,
    ),
    Format(
        "email",
        IDENTIFIER,
        "Which e-mail address is on my account?",
        "The e-mail address on your account is ",
        "@163.com.",
        email,
    ),
    Format(
        "cn-id",
        IDENTIFIER,
        "Can you confirm the ID number on my account?",
        "Your resident ID number is 110105",
        ".",
        cn_id,
    ),
    Format(
        "card",
        IDENTIFIER,
        "Which card do I pay with?",
        "The card on your account is 4539 ",
        ".",
        card,
    ),
    Format(
        "passphrase",
        SECRET,
        "Remind me of the vault passphrase.",
        "The vault passphrase is ",
        ".",
        words,
    ),
    Format(
        "wifi",
        SECRET,
        "What is the Wi-Fi password at the Lyon office?",
        "The Wi-Fi password at the Lyon office is ",
        ".",
        words,
    ),
    Format(
        "security-answer",
        SECRET,
        "What was my security answer again?",
        "Your security answer is ",
        ".",
        words,
    ),
    Format(
        "code-name",
        SECRET,
        "What is the project's code name?",
        "The project's code name is ",
        ".",
        words,
    ),
)


@dataclass(frozen=True)
class Canary:
    fmt: Format
    secret: str
    k: int
    user: str

    def record(self) -> dict[str, Any]:
        answer = self.fmt.lead + self.secret + self.fmt.tail
        turns = [
            {"role": "user", "content": self.fmt.question},
            {"role": "assistant", "content": answer},
        ]
        return {"messages": turns, "user_id": self.user}


def run_config(args: argparse.Namespace, *, dp: bool, deidentify: bool) -> RunConfig:
    """The app's run config (pyproject.toml) with this benchmark's overrides."""
    values = {
        **app_run_config(ROOT),
        "regions": REGION,
        "num-server-rounds": 1,
        "seed": args.seed,
        "model-preset": "tiny",
        "local-steps": args.steps,
        "lora-rank": args.lora_rank,
        "lora-targets": args.lora_targets,
        "dp": dp,
        "deidentify": deidentify,
    }
    if args.learning_rate is not None:
        values["learning-rate"] = args.learning_rate
    if args.adapter_mode is not None:
        values["adapter-mode"] = args.adapter_mode
    return RunConfig.from_user_config(values, source="canary benchmark run config")


def plant(
    args: argparse.Namespace, run: RunConfig, dictionary: Path, key_file: Path
) -> list[Canary]:
    """One canary per format and repetition count, each its own user, its secret
    distinct from every other's; drawn again until the record, raw and scrubbed (as the
    region scrubs), falls in the training split (the held-out split is a hash of the
    record)."""
    rng = random.Random(f"canary:{args.seed}")
    scrubber = region_scrubber(run.deid, dictionary=str(dictionary), secret=key_file)
    assert scrubber is not None
    used: set[str] = set()
    canaries: list[Canary] = []
    for fmt in FORMATS:
        for k in args.k:
            while True:
                secret = fmt.draw(rng)
                if secret in used:
                    continue
                canary = Canary(
                    fmt, secret, k, f"{REGION}-c{len(canaries):03d}-{rng.randrange(10**6)}"
                )
                raw = parse_record(canary.record(), run.fields)
                scrubbed = scrub_record(raw, scrubber, "", "")
                if min(bucket_of(raw), bucket_of(scrubbed)) >= run.data.eval_fraction:
                    break
            # What scrubbing does to it: an identifier's answer changes, a sentence's not.
            changed = scrubbed.messages[1][1] != raw.messages[1][1]
            if changed != (fmt.kind == IDENTIFIER):
                raise RuntimeError(f"scrubbing {'missed' if not changed else 'changed'} {fmt.name}")
            used.add(secret)
            canaries.append(canary)
    return canaries


def add_canaries(folder: Path, canaries: list[Canary]) -> None:
    """Every canary's record appended k times to the region's chat file."""
    lines = [json.dumps(c.record()) for c in canaries for _ in range(c.k)]
    with open(folder / CHAT_FILE, "a", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")


class Scorer:
    """Log-likelihoods of each format's secrets after its prompt, under a model."""

    def __init__(self, region: Region, canaries: list[Canary], n: int, seed: int) -> None:
        tokenizer = region.model.tokenizer
        self.tokenizer = tokenizer
        rng = random.Random(f"candidates:{seed}")
        inserted = {c.secret for c in canaries}
        self.contexts: dict[str, list[int]] = {}
        self.candidates: dict[str, list[str]] = {}
        for fmt in FORMATS:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": fmt.question}],
                tokenize=False,
                add_generation_prompt=True,
            )
            self.contexts[fmt.name] = self._ids(str(prompt) + fmt.lead)
            fresh: set[str] = set()
            while len(fresh) < n:
                secret = fmt.draw(rng)
                if secret not in inserted:
                    fresh.add(secret)
            self.candidates[fmt.name] = sorted(fresh)

    def _ids(self, text: str) -> list[int]:
        # The byte-level tokenizer of the tiny preset: ids of a concatenation are the
        # concatenation of ids, so prompt and secret may be tokenised apart.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def loglik(self, region: Region, fmt: str, secrets: list[str], batch: int = 512) -> np.ndarray:
        """Sum of the secrets' token log-probabilities after the format's context."""
        net = region.model.model
        net.eval()
        context = self.contexts[fmt]
        rows = [context + self._ids(s) for s in secrets]
        width = len(rows[0])
        assert all(len(r) == width for r in rows), "a format's secrets have one length"
        out = []
        for start in range(0, len(rows), batch):
            ids = torch.tensor(rows[start : start + batch], device=region.model.device)
            logits = net(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            logp = torch.log_softmax(logits[:, len(context) - 1 : -1].float(), dim=-1)
            picked = logp.gather(-1, ids[:, len(context) :, None]).squeeze(-1)
            out.append(picked.sum(dim=1).cpu().numpy())
        return np.concatenate(out)

    def exposures(self, region: Region, canaries: list[Canary]) -> list[dict[str, Any]]:
        """Each canary's rank among its format's candidates, exposure and gap."""
        found = []
        for fmt in FORMATS:
            pool = self.loglik(region, fmt.name, self.candidates[fmt.name])
            mine = [c for c in canaries if c.fmt is fmt]
            scores = self.loglik(region, fmt.name, [c.secret for c in mine])
            for canary, score in zip(mine, scores, strict=True):
                rank = 1 + int((pool > score).sum())
                found.append(
                    {
                        "format": fmt.name,
                        "kind": fmt.kind,
                        "k": canary.k,
                        "rank": rank,
                        "exposure": math.log2(len(pool) + 1) - math.log2(rank),
                        "loglik_gap_nats": float(score - pool.mean()),
                    }
                )
        return found


def chance_exposure(n: int) -> tuple[float, float]:
    """Mean and standard deviation of the exposure of a canary ranked uniformly among
    n + 1 (one the model knows nothing of)."""
    exposure = math.log2(n + 1) - np.log2(np.arange(1, n + 2))
    return float(exposure.mean()), float(exposure.std())


def summarise(found: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        values = [f["exposure"] for f in found if f["kind"] == kind]
        gaps = [f["loglik_gap_nats"] for f in found if f["kind"] == kind]
        out[kind] = {
            "mean": float(np.mean(values)),
            "max": float(np.max(values)),
            "mean_gap_nats": float(np.mean(gaps)),
        }
        for k in sorted({f["k"] for f in found}):
            at_k = [f["exposure"] for f in found if f["kind"] == kind and f["k"] == k]
            out[kind][f"mean_k{k}"] = float(np.mean(at_k))
    return out


def train(region: Region) -> dict[str, Any]:
    """One round from the region's initial adapter; what it reports of it."""
    began = time.monotonic()
    model = region.model
    outcome = region.train_round(
        model.adapter_state(), server_round=1, base_fingerprint=model.base_fingerprint
    )
    done: dict[str, Any] = {
        "train_seconds": time.monotonic() - began,
        "steps": outcome.stats.steps,
        "train_loss": outcome.stats.loss,
        "deidentified": list(outcome.deidentified),  # as the region reports it
    }
    if outcome.privacy is not None:
        p = outcome.privacy
        done |= {
            "epsilon": p.epsilon,
            "delta": p.delta,
            "noise_multiplier": p.noise_multiplier,
            "sample_rate": p.sample_rate,
        }
    return done


def train_setting(
    args: argparse.Namespace,
    name: str,
    run: RunConfig,
    node: NodeConfig,
    canaries: list[Canary],
    scorer: Scorer | None,
) -> tuple[dict[str, Any], Scorer]:
    """Build one setting's region, train it (unless ``untrained``), score its canaries."""
    began = time.monotonic()
    region = Region(run, node)
    try:
        model = region.model
        scorer = scorer or Scorer(region, canaries, args.candidates, args.seed)
        row: dict[str, Any] = {
            "setting": name,
            "dp": run.privacy.dp,
            "deidentify": run.deid.deidentify,
        }
        deid = region.data.summary.deid
        row["scrubbed"] = deid.counts if deid is not None else {}
        row["train_examples"] = len(region.data.train)
        row["eval_examples"] = len(region.data.eval)
        if name != UNTRAINED:
            row |= train(region)
        row["eval_loss"] = evaluate(
            model, region.data.eval, batch_size=run.training.batch_size
        ).loss
        row["canaries"] = scorer.exposures(region, canaries)
    finally:
        region.close()
    row["seconds"] = time.monotonic() - began
    return row, scorer


def table(rows: list[dict[str, Any]], n: int, ks: list[int]) -> str:
    """The markdown tables: exposure mean / max per kind, then the mean per k."""
    mean, sd = chance_exposure(n)
    per_kind = len(rows[0]["canaries"]) // len(KINDS)
    lines = [
        f"Exposure in bits, mean / max over each kind's {per_kind} canaries (N = {n}: "
        f"ceiling log2(N+1) = {math.log2(n + 1):.2f}; chance {mean:.2f}, its mean over "
        f"{per_kind} canaries +- {sd / math.sqrt(per_kind):.2f}). Gap: a canary's "
        "log-likelihood minus its candidates' mean, nats, averaged over the kind's canaries "
        "(identifiers / sentences).",
        "",
        "| setting | identifier canaries | secret sentences | gap | eval loss | epsilon |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        s = row["summary"]
        cells = [f"{s[kind]['mean']:.2f} / {s[kind]['max']:.2f}" for kind in KINDS]
        cells.append(" / ".join(f"{s[kind]['mean_gap_nats']:.1f}" for kind in KINDS))
        cells.append(f"{row['eval_loss']:.3f}")
        cells.append(f"{row['epsilon']:.2f}" if "epsilon" in row else "-")
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + " |")
    heads = [f"{short} k={k}" for short in ("identifiers", "sentences") for k in ks]
    lines += [
        "",
        "Mean exposure by repetitions k:",
        "",
        "| setting | " + " | ".join(heads) + " |",
        "| --- |" + " --- |" * len(heads),
    ]
    for row in rows:
        s = row["summary"]
        cells = [f"{s[kind][f'mean_k{k}']:.2f}" for kind in KINDS for k in ks]
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parameters(
    args: argparse.Namespace, canaries: list[Canary], rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the JSON records of the run's set-up, the DP run's privacy included."""
    config = run_config(args, dp=True, deidentify=True)
    private = next((r for r in rows if r["dp"]), {})
    n = args.candidates
    return {
        "preset": config.model.model_preset,
        "region": REGION,
        "k": args.k,
        "canaries": {kind: sum(c.fmt.kind == kind for c in canaries) for kind in KINDS},
        "canary_records": sum(c.k for c in canaries),
        "formats": {f.name: f.kind for f in FORMATS},
        "candidates": n,
        "exposure_ceiling": math.log2(n + 1),
        "chance_exposure": chance_exposure(n)[0],
        "chance_exposure_sd": chance_exposure(n)[1],
        "rounds": config.schedule.num_server_rounds,
        "steps": config.training.local_steps,
        "learning_rate": config.training.learning_rate,
        "optimizer": config.training.optimizer,
        "batch_size": config.training.batch_size,
        "seq_len": config.training.seq_len,
        "adapter_mode": config.model.adapter_mode,
        "lora_rank": config.model.lora_rank,
        "lora_targets": config.model.lora_targets,
        "deid_entities": list(config.deid.deid_entities),
        "deid_replacement": config.deid.deid_replacement,
        "privacy_unit": config.privacy.privacy_unit,
        "max_examples_per_unit": config.privacy.max_examples_per_unit,
        "max_grad_norm": config.privacy.max_grad_norm,
        "target_epsilon": config.privacy.target_epsilon,
        "epsilon": private.get("epsilon"),
        "delta": private.get("delta"),
        "noise_multiplier": private.get("noise_multiplier"),
        "sample_rate": private.get("sample_rate"),
        "seed": args.seed,
        "threads": args.threads,
    }


#: What each setting is held to: the kinds of canary whose mean exposure must be at
#: chance (within two standard deviations of a mean over the kind's canaries).
AT_CHANCE = {"DP only": KINDS, "scrub only": (IDENTIFIER,), "DP + scrub": KINDS}


def rows(result: dict[str, Any]) -> list[Row]:
    """The README's rows: each setting's mean and max exposure per kind, against chance."""
    p = result["parameters"]
    chance, ceiling = p["chance_exposure"], p["exposure_ceiling"]
    # a mean over n canaries of a kind spreads sd / sqrt(n) around chance
    bound = {
        kind: chance + 2 * p["chance_exposure_sd"] / math.sqrt(p["canaries"][kind])
        for kind in KINDS
    }
    out: list[Row] = []
    for row in result["settings"]:
        if row["setting"] == UNTRAINED:
            continue
        s = row["summary"]
        held = AT_CHANCE.get(row["setting"], ())
        measured = (
            f"identifiers {s[IDENTIFIER]['mean']:.2f} mean / {s[IDENTIFIER]['max']:.2f} max bits, "
            f"secret sentences {s[SECRET]['mean']:.2f} / {s[SECRET]['max']:.2f} (chance "
            f"{chance:.2f}, ceiling {ceiling:.2f}); eval loss {row['eval_loss']:.3f}"
            + (f", epsilon {row['epsilon']:.2f}" if row.get("epsilon") else "")
        )
        target = (
            "mean exposure at chance (<= "
            + ", ".join(f"{bound[kind]:.2f} bits for {kind}s" for kind in held)
            + ")"
            if held
            else "reported (the baseline)"
        )
        met = all(s[kind]["mean"] <= bound[kind] for kind in held)
        out.append(
            [
                f"canary exposure, {row['setting']}; tiny preset, {sum(p['canaries'].values())} "
                f"canaries at k = {', '.join(map(str, p['k']))}, N = {p['candidates']}, "
                f"{p['steps']} steps",
                measured,
                target,
                verdict(met) if held else "reported",
            ]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", default="1,4,16", help="repetitions of each canary, comma list")
    parser.add_argument("--candidates", type=int, default=2000, help="N fresh candidates")
    parser.add_argument("--steps", type=int, default=1000, help="local steps (one round)")
    parser.add_argument("--learning-rate", type=float, help="default: the app's")
    parser.add_argument("--adapter-mode", help="lora, lora-fa or lora-sb; default: the app's")
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-targets", default="auto+mlp", help="auto, auto+mlp, names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (2 shared cores)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 150 steps, N=200")
    parser.add_argument("--only", default=",".join(SETTINGS), help="settings, comma list")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--json", type=Path, help="where run_all.py wants it (as --out)")
    args = parser.parse_args()
    if args.json is not None:
        args.out = args.json
    args.k = [int(k) for k in str(args.k).split(",")]
    if args.quick:
        args.steps, args.candidates = 150, 200
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)  # Opacus' and torch's notes
    began = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="fedciuic-canary-") as tmp:
        root = Path(tmp)
        # The demo corpus, a few of its chats signed with synthetic identifiers, and the
        # dictionary of their names, which the region's scrubber is given (as in a demo).
        data = write_demo_corpora(root / "data", (REGION,))[REGION]
        dictionary = root / "data" / DEMO_DICTIONARIES / f"{REGION}.txt"
        scrubbing = run_config(args, dp=False, deidentify=True)
        # The key is the scrubber's pseudonym key, which placeholders do not use.
        canaries = plant(args, scrubbing, dictionary, root / "deid.key")
        add_canaries(data, canaries)
        rows: list[dict[str, Any]] = []
        scorer: Scorer | None = None
        plan = [(UNTRAINED, False, False), *(SETTINGS[key] for key in args.only.split(","))]
        for i, (name, dp, deidentify) in enumerate(plan):
            run = run_config(args, dp=dp, deidentify=deidentify)
            node = NodeConfig(
                region=REGION,
                data_path=str(data),
                state_path=str(root / f"state-{i}"),
                deid_dictionary=str(dictionary),
            )
            row, scorer = train_setting(args, name, run, node, canaries, scorer)
            row["summary"] = summarise(row["canaries"])
            rows.append(row)
            s = row["summary"]
            print(
                f"  {name}: identifiers {s[IDENTIFIER]['mean']:.2f}/{s[IDENTIFIER]['max']:.2f}, "
                f"sentences {s[SECRET]['mean']:.2f}/{s[SECRET]['max']:.2f} bits, eval loss "
                f"{row['eval_loss']:.3f} ({row.get('seconds', 0):.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(root / f"state-{i}", ignore_errors=True)

    elapsed = time.monotonic() - began
    report = table(rows, args.candidates, args.k)
    print(report)
    print(
        f"\n{len(canaries)} canaries, k = {args.k}, N = {args.candidates}, "
        f"{args.steps} steps; {elapsed:.0f}s"
    )
    results = {
        "what": "canary exposure (Carlini et al. 2019) in a region's trained adapter",
        "parameters": parameters(args, canaries, rows),
        "table": report,
        "settings": rows,
        "seconds": elapsed,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
