#!/usr/bin/env python3
"""Reads the flight records a tinyscale job left (DIR/rank_<r>.json, one per rank) and says what went
wrong across the ranks. The first line is the verdict: the earliest collective that not every
member joined (and which ranks are missing), the earliest message one side never posted, or the
first call whose op, size or dtype differs between ranks; the details follow.

Matching (see common/comm/flight_recorder.h): the n-th collective on a communicator is one call on every
member; the n-th message from rank a to rank b with tag t on a communicator is one message at both
ends. A communicator is known by its name, its world ranks and how many like it came before.

Only the standard library: any python3 runs it (python3 scripts/flight_analyze.py DIR).
Exit status: 0 when nothing is wrong, 1 when a problem is named, 2 when DIR holds no record."""
import glob
import json
import os
import re
import sys


def load(d):
    dumps = {}
    for path in sorted(glob.glob(os.path.join(d, "rank_*.json"))):
        try:
            with open(path) as f:
                j = json.load(f)
        except (OSError, ValueError) as e:
            print(f"warning: {path}: {e}", file=sys.stderr)
            continue
        dumps[j["rank"]] = j
    return dumps


def group_key(g):
    return (g["name"], tuple(g["ranks"]), g.get("instance", 0))


def describe(e):
    return f"{e['op']} {e['dtype']} x {e['count']} ({e['bytes']} B)"


def signature(e):
    return (e["op"], e["count"], e["dtype"], e.get("root", -1))


class Job:
    def __init__(self, dumps):
        self.dumps = dumps
        self.world = max(j["world"] for j in dumps.values())
        self.silent = [r for r in range(self.world) if r not in dumps]  # no record at all
        self.coll = {}   # (gkey, seq) -> {rank: entry}
        self.sends = {}  # (gkey, src, dst, tag, seq) -> entry at src
        self.recvs = {}  # (gkey, src, dst, tag, seq) -> entry at dst
        self.reach = {}  # (rank, gkey) -> highest collective seq recorded
        self.wrapped = {r: j.get("dropped", 0) > 0 for r, j in dumps.items()}
        self.msg_reach = {}  # (rank, gkey, src, dst, tag) -> highest message seq recorded
        for r, j in dumps.items():
            groups = {g["id"]: g for g in j["groups"]}
            for e in j["entries"]:
                g = groups[e["group"]]
                k = group_key(g)
                e["_rank"], e["_g"] = r, k
                if e["kind"] == "collective":
                    self.coll.setdefault((k, e["seq"]), {})[r] = e
                    self.reach[(r, k)] = max(self.reach.get((r, k), 0), e["seq"])
                else:
                    peer = g["ranks"][e["peer"]]
                    src, dst = (r, peer) if e["op"] == "send" else (peer, r)
                    key = (k, src, dst, e["tag"], e["seq"])
                    (self.sends if e["op"] == "send" else self.recvs)[key] = e
                    mk = (r, k, src, dst, e["tag"])
                    self.msg_reach[mk] = max(self.msg_reach.get(mk, 0), e["seq"])

    def never_reached(self, rank, k, seq, since=0):
        """True when rank's record shows it did not get to collective seq of group k, which another
        rank entered at time `since` (a record written before then is no evidence: a SIGUSR1
        snapshot catches ranks a moment apart)."""
        if rank not in self.dumps:
            return True
        if self.dumps[rank]["time"] < since:
            return False
        top = self.reach.get((rank, k))
        if top is None:
            return not self.wrapped[rank]  # a full ring may have dropped the group's entries
        return top < seq

    def problems(self):
        out = []  # (time, first line, details)
        for (k, seq), by_rank in self.coll.items():
            name, members, _ = k
            sigs = {r: signature(e) for r, e in by_rank.items()}
            some = next(iter(by_rank.values()))
            t = min(e["t_enqueued"] or 0 for e in by_rank.values())
            if len(set(sigs.values())) > 1:
                out.append((t, self.mismatch(k, seq, by_rank), ""))
                continue
            # A collective one member completed had every member (a broadcast's root aside, which
            # may finish early: it waits for nobody).
            if any(e["state"] == "completed" for e in by_rank.values()):
                continue
            since = max(e["t_enqueued"] or 0 for e in by_rank.values())
            missing = [m for m in members if m not in by_rank and self.never_reached(m, k, seq, since)]
            if missing:
                waiting = sorted(by_rank)
                states = ", ".join(f"rank {r} {by_rank[r]['state']}" for r in waiting)
                out.append((t, f"{some['what']}: rank{'s' if len(missing) > 1 else ''} "
                               f"{', '.join(map(str, missing))} never joined{self.why(missing)}; "
                               f"{states} (collective {seq} on '{name}', members {list(members)})", ""))
        out += self.p2p_problems()
        return sorted(out, key=lambda p: p[0])

    def mismatch(self, k, seq, by_rank):
        name, members, _ = k
        kinds = {}
        for r, e in sorted(by_rank.items()):
            kinds.setdefault(signature(e), []).append(r)
        parts = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                          f"{by_rank[rs[0]]['what']} [{describe(by_rank[rs[0]])}]" for rs in kinds.values())
        odd = ""
        if len(kinds) == 2 and len(by_rank) > 2:  # one rank against the rest: name it
            few = min(kinds.values(), key=len)
            if len(few) == 1:
                odd = f"; rank {few[0]} is the odd one out"
        # The same call site (its label without the number) with other arguments, or another call.
        same_op = len({re.sub(r" #\d+", "", by_rank[rs[0]]["what"]) for rs in kinds.values()}) == 1
        cause = ("the same op with another size, dtype or root" if same_op else
                 "another call in this place: a rank skipped a collective or made an extra one")
        return f"mismatch: collective {seq} on '{name}' (members {list(members)}) is {cause}{odd}: {parts}"

    def why(self, ranks):
        silent = [r for r in ranks if r in self.silent]
        if not silent:
            return ""
        return " (no flight record from " + ", ".join(f"rank {r}" for r in silent) + \
               ": stopped, killed, or stuck where it could not answer)"

    def p2p_problems(self):
        out = []
        for key, e in list(self.recvs.items()) + list(self.sends.items()):
            k, src, dst, tag, seq = key
            mine, other_side, other = (dst, src, self.sends) if e["op"] == "recv" else (src, dst, self.recvs)
            match = other.get(key)
            if match is not None:
                if match["count"] != e["count"] or match["dtype"] != e["dtype"]:
                    snd, rcv = (match, e) if e["op"] == "recv" else (e, match)
                    out.append((e["t_enqueued"] or 0,
                                f"mismatch: message {seq} from rank {src} to rank {dst} (tag {tag}) on '{k[0]}': "
                                f"sent {describe(snd)}, received into {describe(rcv)}", ""))
                continue
            if e["state"] == "completed":
                continue
            reached = self.msg_reach.get((other_side, k, src, dst, tag), 0)
            if other_side in self.dumps and (reached >= seq or self.wrapped[other_side] or
                                             self.dumps[other_side]["time"] < (e["t_enqueued"] or 0)):
                continue
            verb = "sent" if e["op"] == "recv" else "received"
            # A receive that waits names the missing sender more directly than the send beside it.
            out.append((round(e["t_enqueued"] or 0, 3) + (0 if e["op"] == "recv" else 1e-4),
                        f"{e['what']}: rank {mine} waits ({e['op']} {seq} from rank {src} to rank {dst}), rank "
                        f"{other_side} never {verb} it{self.why([other_side])}", ""))
        return out

    def details(self):
        lines = []
        for r in range(self.world):
            j = self.dumps.get(r)
            if j is None:
                lines.append(f"rank {r}: no flight record")
                continue
            pending = [e for e in j["entries"] if e["state"] != "completed"]
            done = [e for e in j["entries"] if e["state"] == "completed"]
            last = f"; last completed: {done[-1]['what']}" if done else ""
            lines.append(f"rank {r} (step {j['step']}, {j['recorded']} calls recorded{last}): {j['reason']}")
            for e in pending[-5:]:
                lines.append(f"    {e['state']:9s} {e['what']} [{describe(e)}]")
        return lines


def main(argv):
    if len(argv) != 2 or argv[1] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0] + "\n\nusage: flight_analyze.py DIR", file=sys.stderr)
        return 2
    dumps = load(argv[1])
    if not dumps:
        print(f"no flight records (rank_<r>.json) in {argv[1]}")
        return 2
    job = Job(dumps)
    found = job.problems()
    if found:
        print(found[0][1])
    else:
        print(f"no collective left unjoined and no call mismatched across the {len(dumps)} records")
    for p in found[1:4]:
        print("also: " + p[1])
    try:
        for line in job.details():
            print(line)
    except BrokenPipeError:  # flight_analyze.py DIR | head -1
        pass
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
