"""``collectives-trace DIR [--json]``: read every rank's dump and say who is behind, in which call.

    collectives-trace /tmp/trace            # a verdict first, details after
    collectives-trace /tmp/trace --json     # one JSON object (see analyze())
    python -m collectives.diagnostics.trace /tmp/trace

The dumps are the ``rank-<R>.json`` files that ranks write with ``COLLECTIVES_TRACE_DIR``
set (see ``collectives.diagnostics.recorder``). For each communicator (the world, and every split by
its place in the split tree) the ranks' rings are lined up by sequence number:

- a **mismatch**: the first call that the ranks made differently (operation, dtype, shape or
  root); ``odd`` are the ranks whose call differs from the majority's;
- a **hang**: the first call that not every rank completed; ``behind`` are the ranks that
  never entered it (with their last completed call, call site, and main thread's stack);
  a rank that wrote no dump is named as such (killed with SIGKILL, or the host died);
- a **crash**: a rank died of an uncaught exception and no dump shows a rank waiting (under
  mpiexec, ``MPI_Abort`` has the launcher kill the others before they can write); ``call`` is
  its last completed call on any communicator;
- **finished**: the ranks behind ended normally (their dump says so): the others made more
  calls than they did;
- **signal**: a rank was ended by a signal (SIGTERM, SIGINT) first, and the ranks that did not
  reach its call are those the launcher ended after it (no dump, or a dump on the launcher's
  signal later): they are not blamed, the rank signalled first is named;
- **no dumps**: the folder holds none (the ranks were killed before they could write, or did
  not have ``COLLECTIVES_TRACE_DIR`` set);
- **ok**: every rank that wrote a dump completed every call the others made.

The exit status is 0 for **ok** only. An asynchronous call counts as completed once its dump
says so, or once a later collective of the same communicator completed there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import Counter
from typing import Any

from .recorder import COMPLETED, FORMAT, POINT_TO_POINT, POSTED

# A call as the ranks compare it.
_Signature = tuple[Any, ...]
#: Dump reasons of a rank ended by a signal (the watcher writes them; see process_hooks).
TERMINATING = ("SIGTERM", "SIGINT")
#: Seconds after the first terminating-signal dump from which another rank's such dump counts
#: as the launcher's ending it (a signal the launcher forwards reaches every rank at once).
LAUNCHER_GAP = 0.25


def load(directory: str) -> dict[int, dict[str, Any]]:
    """world rank -> its dump, for every ``rank-<R>.json`` in ``directory``."""
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank-*.json"))):
        with open(path) as file:
            content = json.load(file)
        if content.get("format") != FORMAT:
            raise ValueError(f"{path}: dump format {content.get('format')!r}; this "
                             f"collectives-trace reads format {FORMAT}")
        dumps[int(content["rank"])] = content
    return dumps


def _signature(call: dict[str, Any]) -> _Signature:
    return (call["op"], call["dtype"], tuple(call["shape"] or ()), call["root"], call.get("redop"))


def _describe_call(call: dict[str, Any] | None) -> str:
    if call is None:
        return "none recorded"
    shape = "" if call["shape"] is None else f" {call['dtype']}{tuple(call['shape'])}"
    shape += f" {call['redop']}" if call.get("redop") else ""
    root = f" root {call['root']}" if call["root"] is not None and call["root"] >= 0 else ""
    site = f" at {call['site']}" if call.get("site") else ""
    return f"#{call['seq']} {call['op']}{shape}{root}{site}"


class _Member:
    """One rank's view of one communicator."""

    def __init__(self, world_rank: int, dump: dict[str, Any], entry: dict[str, Any]) -> None:
        self.world_rank, self.dump = world_rank, dump
        self.rank, self.size, self.seq = entry["rank"], entry["size"], entry["seq"]
        self.calls = {call["seq"]: call for call in entry["calls"]
                      if call["seq"] > 0 and call["op"] not in POINT_TO_POINT}
        self.oldest = min(self.calls, default=self.seq + 1)

    def entered(self, seq: int) -> bool:
        return seq <= int(self.seq)

    def completed(self, seq: int) -> bool:
        if seq > self.seq:
            return False
        if seq < self.oldest:
            return True  # older than the ring: it completed, since later calls were made
        call = self.calls.get(seq)
        if call is None or call["state"] == COMPLETED:
            return True
        # Posted (asynchronous), not seen completing: it did if a later collective completed.
        return call["state"] == POSTED and any(later["state"] == COMPLETED
                                               for number, later in self.calls.items() if number > seq)

    def last_completed(self) -> dict[str, Any] | None:
        done = [call for seq, call in self.calls.items() if self.completed(seq)]
        return max(done, key=lambda call: call["seq"]) if done else None


def _communicators(dumps: dict[int, dict[str, Any]]) -> dict[str, list[_Member]]:
    found: dict[str, list[_Member]] = {}
    for world_rank, content in sorted(dumps.items()):
        for entry in content["communicators"]:
            found.setdefault(entry["name"], []).append(_Member(world_rank, content, entry))
    return found


def _main_stack(dump: dict[str, Any]) -> list[str]:
    for thread in dump.get("threads", []):
        if thread.get("main"):
            return [line for line in thread["stack"]
                    if f"collectives{os.sep}recorder.py" not in line
                    and f"collectives{os.sep}process_hooks.py" not in line]
    return []


def _analyze_one(name: str, members: list[_Member], world_size: int) -> dict[str, Any] | None:
    """The verdict for one communicator, or None when its dumped ranks agree on every call."""
    size = members[0].size
    present = {member.rank for member in members}
    # Which world rank each rank of this communicator is, where a dump says.
    world_of = {member.rank: member.world_rank for member in members}
    is_world = size == world_size and all(m.rank == m.world_rank for m in members)
    missing = sorted(set(range(size)) - present)
    seqs = sorted({seq for member in members for seq in member.calls})
    verdict: dict[str, Any] | None = None
    for seq in seqs:
        made = {m.rank: m.calls[seq] for m in members if seq in m.calls}
        signatures = Counter(_signature(call) for call in made.values())
        if len(signatures) > 1:
            majority = signatures.most_common(1)[0][0]
            odd = sorted(rank for rank, call in made.items() if _signature(call) != majority)
            verdict = {"verdict": "mismatch", "seq": seq, "odd": odd,
                       "call": next(c for c in made.values() if _signature(c) == majority)}
            break
        if not all(m.completed(seq) for m in members):
            verdict = {"verdict": "hang", "seq": seq, "odd": [], "call": next(iter(made.values()))}
            break
    weak = False
    if verdict is None:
        if not missing or not seqs:
            return None
        last = seqs[-1]  # every dumped rank completed everything: the silent ones are the question
        verdict = {"verdict": "hang", "seq": last, "odd": [],
                   "call": next(m.calls[last] for m in members if last in m.calls)}
        weak = True  # no dumped rank waits here: a real hang elsewhere comes first
    seq = verdict["seq"]
    behind_ranks = sorted({m.rank for m in members if not m.entered(seq)} | set(missing))
    entered = sorted(m.rank for m in members if m.entered(seq))

    def world(rank: int) -> int | None:
        return world_of.get(rank, rank if is_world else None)

    call = verdict["call"]
    behind = []
    for rank in behind_ranks:
        member = next((m for m in members if m.rank == rank), None)
        behind.append({"rank": rank, "world_rank": world(rank), "no_dump": member is None,
                       "last_completed": None if member is None else member.last_completed(),
                       "reason": None if member is None else member.dump.get("reason"),
                       "stack": [] if member is None else _main_stack(member.dump)})
    return {
        "verdict": verdict["verdict"], "communicator": name, "size": size, "weak": weak,
        "call": {"seq": seq, "op": call["op"], "dtype": call["dtype"],
                 "shape": call["shape"], "root": call["root"], "redop": call.get("redop"),
                 "communicator": name},
        "entered": entered, "behind_ranks": behind_ranks, "odd_ranks": verdict["odd"],
        "behind_detail": behind, "world_of": {rank: world(rank) for rank in range(size)},
        "states": {m.rank: (m.calls[seq]["state"] if seq in m.calls else
                            "not entered" if not m.entered(seq) else COMPLETED) for m in members},
        "errors": {m.rank: m.calls[seq].get("error") for m in members
                   if seq in m.calls and m.calls[seq].get("error")},
    }


def analyze(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> dict[str, Any]:
    """The verdict as one object: ``world_size``, ``dumps`` (ranks that wrote one), ``verdict``
    ("hang", "mismatch", "crash", "finished", "signal", "no dumps" or "ok"; see the module's
    text), ``call`` (``seq``, ``op``, ``dtype``, ``shape``, ``root``, ``redop``,
    ``communicator``; None when ok; for a crash the crashed rank's last completed call),
    ``behind`` and ``odd`` (sorted world ranks; a rank of a split whose world rank no dump
    tells is given as -1), ``no_dump`` (world ranks that wrote none) and ``no_dump_why`` (the
    likely reason, in words), ``crashed`` (ranks that died of an uncaught exception outside any
    call), ``signalled`` (for a signal: the rank signalled first, and when), ``reasons`` (why
    each rank wrote its dump) and ``details``."""
    if world_size is None:
        world_size = max((int(d["world_size"]) for d in dumps.values()), default=0)
    communicators = _communicators(dumps)
    found = {name: _analyze_one(name, members, world_size) for name, members in communicators.items()}
    problems = [result for result in found.values() if result is not None]
    no_dump = sorted(set(range(world_size)) - set(dumps))
    result: dict[str, Any] = {
        "world_size": world_size, "dumps": sorted(dumps), "verdict": "ok", "call": None,
        "behind": [], "odd": [], "no_dump": no_dump, "no_dump_why": _why_no_dump(dumps),
        "crashed": [], "signalled": None,
        "reasons": {str(rank): dump.get("reason") for rank, dump in sorted(dumps.items())},
        "details": None,
    }
    if not dumps:
        result["verdict"] = "no dumps"
        return result
    # Ranks inside a call when they wrote their dump (waiting, or failed there: a timeout, a
    # peer that died); ranks that died of an uncaught exception outside any call.
    waiting = {rank for rank, dump in dumps.items() for entry in dump["communicators"]
               for call in entry["calls"] if call["state"] in ("started", "failed")}
    result["crashed"] = sorted(rank for rank, dump in dumps.items() if rank not in waiting
                               and str(dump.get("reason", "")).startswith("uncaught"))
    if result["crashed"] and not waiting:
        # No dump shows a rank waiting for another: the crash is the story (the launcher
        # killed the other ranks before they could write, as mpiexec does on MPI_Abort).
        rank = result["crashed"][0]
        calls = [(name, last) for name, members in communicators.items() for member in members
                 if member.world_rank == rank and (last := member.last_completed()) is not None]
        if calls:  # its latest completed call, on whichever communicator
            name, last = max(calls, key=lambda found: float(found[1]["start"]))
            result["call"] = {"seq": last["seq"], "op": last["op"], "dtype": last["dtype"],
                              "shape": last["shape"], "root": last["root"],
                              "redop": last.get("redop"), "communicator": name}
        result["verdict"] = "crash"
        return result
    terminating = {rank: float(dump.get("time") or 0.0) for rank, dump in dumps.items()
                   if dump.get("reason") in TERMINATING}
    first = min(terminating, key=lambda rank: (terminating[rank], rank)) if terminating else None
    if first is not None:
        result["signalled"] = {"rank": first, "signal": dumps[first]["reason"], "time": terminating[first]}
    if not problems and no_dump:  # nothing recorded disagrees; the silent ones are the question
        result.update(verdict="signal" if first is not None else "hang", behind=no_dump)
        return result
    if not problems:
        if first is not None:
            result["verdict"] = "signal"
        return result
    # A mismatch explains the rest; else the hang whose ranks behind are not themselves
    # waiting in another call (they are the cause, the others follow); then one that a dumped
    # rank waits in; then the earliest.
    def order(problem: dict[str, Any]) -> tuple[bool, bool, bool, float]:
        starts = [m.calls[problem["call"]["seq"]]["start"] for m in communicators[problem["communicator"]]
                  if problem["call"]["seq"] in m.calls]
        behind = {problem["world_of"][rank] for rank in problem["behind_ranks"]}
        return (problem["verdict"] != "mismatch", bool(behind & waiting), problem["weak"],
                min(starts, default=0.0))
    chosen = min(problems, key=order)
    world_of = chosen["world_of"]
    behind = sorted(-1 if world_of[r] is None else world_of[r] for r in chosen["behind_ranks"])
    result.update(
        verdict=chosen["verdict"], call=chosen["call"], behind=behind,
        odd=sorted(-1 if world_of[r] is None else world_of[r] for r in chosen["odd_ranks"]),
        details=chosen)
    if chosen["verdict"] != "hang" or not behind:
        return result

    def ended_by_launcher(rank: int) -> bool:  # after the first signalled rank, not before it
        return rank not in dumps or (rank in terminating and first is not None
                                     and terminating[rank] - terminating[first] > LAUNCHER_GAP)
    if first is not None and first not in behind and all(ended_by_launcher(r) for r in behind):
        result["verdict"] = "signal"
    elif all(str(dumps[r].get("reason", "")).startswith("exit") for r in behind if r in dumps) \
            and any(r in dumps for r in behind):
        result["verdict"] = "finished"
    return result


def _why_no_dump(dumps: dict[int, dict[str, Any]]) -> str:
    """Why ranks of this job wrote no dump, as far as the others' dumps tell."""
    for rank, dump in sorted(dumps.items(), key=lambda item: float(item[1].get("time") or 0.0)):
        reason = str(dump.get("reason", ""))
        if reason.startswith(("uncaught", "sys.exit")) and dump.get("launcher") != "torchrun":
            return (f"ended by the job's MPI_Abort after rank {rank}'s {reason.split(':')[0]} (the "
                    "launcher ends every rank at once), before it could write")
        if reason in TERMINATING:
            return (f"ended by the launcher after rank {rank} was ended by {reason}, before it "
                    "could write")
    return "killed (SIGKILL, out of memory) or its host died"


def _text(result: dict[str, Any]) -> str:
    lines = []
    call, details = result["call"], result["details"]
    dumped = ", ".join(map(str, result["dumps"])) or "none"
    signalled = result["signalled"]
    if result["verdict"] == "no dumps":
        lines.append("no dumps: the folder holds no rank-<R>.json: the ranks were killed before "
                     "they could write (SIGKILL, out of memory), or COLLECTIVES_TRACE_DIR was not "
                     "set to this folder for them")
        return "\n".join(lines)
    if result["verdict"] == "crash":
        rank = result["crashed"][0]
        where = f" on communicator {call['communicator']!r}" if call and call["communicator"] != "world" else ""
        lines.append(f"crash: rank {rank} died of an {result['reasons'][str(rank)]}; its last completed "
                     f"call: {_describe_call(call)}{where}; no dump shows a rank waiting for it")
    elif result["verdict"] == "ok":
        lines.append(f"ok: the {len(result['dumps'])} ranks that wrote a dump (of {result['world_size']}) "
                     "agree on every call they recorded")
    elif details is None:
        if result["verdict"] == "signal":
            lines.append(f"signal: rank {signalled['rank']} was ended by {signalled['signal']} first; "
                         f"no dump shows a rank waiting for another")
        else:
            lines.append(f"hang: no rank recorded a call; ranks without a dump: {result['no_dump']}")
    else:
        where = call["communicator"]
        described = _describe_call({**call, "site": None})
        size = f" (size {details['size']})" if where != "world" else ""
        if result["verdict"] == "mismatch":
            lines.append(f"mismatch: call {described} on communicator {where!r}{size}: "
                         f"rank(s) {details['odd_ranks']} made a different call")
        elif result["verdict"] == "signal":
            lines.append(f"signal: rank {signalled['rank']} was ended by {signalled['signal']} first, "
                         f"in or after call {described} on communicator {where!r}{size}; rank(s) "
                         f"{result['behind']} did not reach it because the launcher ended them after "
                         "it (not a hang they caused)")
        elif result["verdict"] == "finished":
            lines.append(f"finished: rank(s) {details['behind_ranks']} ended normally before call "
                         f"{described} on communicator {where!r}{size}, which rank(s) "
                         f"{details['entered']} made: the ranks made different numbers of calls")
        else:
            lines.append(f"hang: call {described} on communicator {where!r}{size}: entered by "
                         f"rank(s) {details['entered']}; behind: rank(s) {details['behind_ranks']}")
        for rank, state in sorted(details["states"].items()):
            error = details["errors"].get(rank)
            lines.append(f"  rank {rank}: {state}" + (f" ({error})" if error else ""))
        for behind in details["behind_detail"]:
            who = f"rank {behind['rank']}" + (f" (world rank {behind['world_rank']})"
                                              if behind["world_rank"] not in (None, behind["rank"]) else "")
            if behind["no_dump"]:
                lines.append(f"  {who} wrote no dump: {result['no_dump_why']}")
                continue
            lines.append(f"  {who} is behind: last completed call "
                         f"{_describe_call(behind['last_completed'])}; it wrote its dump on: {behind['reason']}")
            if behind["stack"]:
                lines.append("    main thread was at:")
                lines.extend("    " + line.rstrip().replace("\n", "\n    ") for line in behind["stack"][-3:])
    if result["no_dump"] and details is not None and not any(b["no_dump"] for b in details["behind_detail"]):
        lines.append(f"ranks without a dump: {result['no_dump']} ({result['no_dump_why']})")
    lines.append(f"dumps from rank(s): {dumped} of world size {result['world_size']}")
    for rank, reason in result["reasons"].items():
        lines.append(f"  rank {rank}: {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="collectives-trace",
        description="Merge the ranks' flight-recorder dumps (COLLECTIVES_TRACE_DIR) and name "
                    "the rank that is behind and the call.")
    parser.add_argument("directory", help="the COLLECTIVES_TRACE_DIR the ranks wrote to")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks in the job (default: as the dumps say)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        parser.error(f"{args.directory} is not a directory")
    result = analyze(load(args.directory), args.world_size)
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print(_text(result))
    return 0 if result["verdict"] == "ok" else 1  # (no dumps included: never "ok")


if __name__ == "__main__":
    sys.exit(main())
