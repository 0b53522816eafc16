"""The status page at ``GET /status`` of every node's admin listener (the UI is at ``/``).

One small HTML document, no external assets: the node renders it on the
server from ``api.cluster_view`` (every member's own status, gathered by this
node), and a few lines of inline script fetch ``/status?part=body`` every 2 seconds
and swap the content in, so the page refreshes on its own (without script,
reload by hand). It shows the datacenter's nodes (role, epoch, readiness,
elections and step-downs by reason, the event loop's lag, the GC's longest pause),
replication (publisher flow holds and ha-replicate changes included) per backup
and per queue, recent failovers and the TxLog's state.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from brokerha.admin.node_view import NodeView
from brokerha.httpapi.server import Request, Response

Node = NodeView  # what these endpoints read of the node (admin/node_view.py)

REFRESH_MS = 2000

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:.25em .6em;
text-align:left}th{background:#f0f0f0}.num{text-align:right}.muted{color:#777}
.primary{color:#05640a;font-weight:bold}.backup{color:#0a3d91}.down{color:#b00020;font-weight:bold}
.joining{color:#a05a00}.yes{color:#05640a}.no{color:#b00020}#stale{color:#b00020}
"""

SCRIPT = """
(function(){var main=document.getElementById('main'),stale=document.getElementById('stale');
function tick(){fetch('/status?part=body',{cache:'no-store'}).then(function(r){
if(!r.ok)throw new Error(r.status);return r.text();}).then(function(t){main.innerHTML=t;
stale.textContent='';}).catch(function(e){stale.textContent=' (this node does not answer: '+e+
'; showing the last view)';});}
setInterval(tick,REFRESH_MS);})();
""".replace("REFRESH_MS", str(REFRESH_MS))


def install(node: Node) -> None:
    page = StatusPage(node)
    node.admin.route("GET", "/status", page.handle)


class StatusPage:
    def __init__(self, node: Node) -> None:
        self.node = node

    async def handle(self, request: Request) -> Response:
        from brokerha.admin.api import cluster_view

        view = await cluster_view(self.node)
        body = render_body(view)
        if request.query.get("part") == ["body"]:
            return Response(200, body.encode(), "text/html; charset=utf-8")
        return Response(200, render_page(view, body).encode(), "text/html; charset=utf-8")


def render_page(view: dict[str, Any], body: str) -> str:
    title = f"brokerha {view.get('cluster') or view.get('asked')}"
    return (f"<!doctype html><html><head><meta charset=utf-8><title>{escape(title)}</title>"
            f"<meta name=viewport content='width=device-width'><style>{STYLE}</style></head>"
            f"<body><h1>{escape(title)}<span id=stale></span></h1><div id=main>{body}</div>"
            f"<script>{SCRIPT}</script></body></html>")


def _yes(flag: Any) -> str:
    return "<span class=yes>yes</span>" if flag else "<span class=no>no</span>"


def _cell(value: Any, cls: str = "") -> str:
    text = "–" if value is None else escape(str(value))
    return f"<td class={cls}>{text}</td>" if cls else f"<td>{text}</td>"


def _alarms(alarms: Any) -> str:
    """Resource alarms blocking publishers (memory, disk, disk:store, disk:<backup>), why."""
    if not alarms:
        return "–"
    return "<br>".join(f"<span class=down title='{escape(str(why))}'>{escape(str(name))}</span>"
                       f": {escape(str(why))}" for name, why in sorted(alarms.items()))


def _counts(counts: Any) -> str:
    return ", ".join(f"{escape(str(k))} {escape(str(v))}"
                     for k, v in sorted((counts or {}).items()) if v)


def _elections(election: Any, now: float) -> str:
    """An HA member's campaigns by why it stood, its step-downs as primary by why, the last
    campaign and late heartbeats (cluster/election.py, node/ha.py's status)."""
    if not election:
        return "–"
    out = [f"stood: {_counts(election.get('elections'))}" if _counts(election.get("elections"))
           else "<span class=muted>never stood</span>"]
    if _counts(election.get("stepdowns")):
        out.append(f"stepped down: {_counts(election.get('stepdowns'))}")
    last = election.get("last_election")
    if last:
        out.append(f"<span class=muted>last: {escape(str(last.get('reason')))}, "
                   f"{escape(_ago(float(last.get('at', now)), now))}</span>")
    if election.get("heartbeats_late"):
        out.append(f"late heartbeats: {escape(str(election['heartbeats_late']))}")
    return "<br>".join(out)


def _loop(loop: Any) -> str:
    """The event loop's lag over the last minute (node/loop_monitor.py): p99 / max."""
    if not loop:
        return "–"
    p99, worst = float(loop.get("lag_p99", 0)) * 1000, float(loop.get("lag_max", 0)) * 1000
    text = f"{p99:.1f} / {worst:.1f} ms"
    if loop.get("stalls"):
        text += f" <span class=muted>({escape(str(loop['stalls']))} stalls)</span>"
    return text


def _gc(stats: Any) -> str:
    """The cyclic GC (node/gc_governor.py): the longest pause, collections by generation."""
    if not stats:
        return "–"
    worst = float(stats.get("pause_seconds_max", 0)) * 1000
    collections = "/".join(str(c) for c in stats.get("collections") or [])
    return (f"{worst:.1f} ms <span class=muted>(collections {escape(collections)}, "
            f"{escape(str(stats.get('frozen')))} frozen)</span>")


def _flow(rep: dict[str, Any]) -> str:
    """Publisher flow control on the primary (broker/flow.py): held now, by whose lag, and
    the holds so far."""
    if "publishers_held" not in rep:
        return ""
    now = (f"<span class=down>held</span> ({escape(str(rep.get('publishers_held_by')))})"
           if rep.get("publishers_held") else "no")
    return (f"; publishers held (flow): <span id=flow>{now}</span> <span class=muted>"
            f"({escape(str(rep.get('publisher_holds')))} holds, "
            f"{float(rep.get('publishers_held_seconds') or 0):.1f} s)</span>")


def _replicate_changes(rep: dict[str, Any]) -> str:
    """ha-replicate changes of existing queues on the primary (docs/ha.md, "Replication"):
    the queues whose change is not applied yet (named in the title), the backups it waits
    for, and the changes applied and joins again asked so far."""
    changes = rep.get("replicate_changes")
    if changes is None:
        return ""
    if changes.get("pending"):
        named = "; ".join(str(q) for q in changes.get("queues") or [])
        again = ", ".join(str(n) for n in changes.get("backups_to_join_again") or []) or "none"
        now = (f"<span class=joining title='{escape(named)}'>"
               f"{escape(str(changes.get('queues_pending')))} queues not applied</span> "
               f"(joining again: {escape(str(changes.get('joining_again') or '–'))}; "
               f"to join again: {escape(again)})")
    else:
        now = "none pending"
    return (f"; ha-replicate changes: <span id=replicate-changes>{now}</span> "
            f"<span class=muted>({escape(str(changes.get('applied_queues', 0)))} applied, "
            f"{escape(str(changes.get('joins_asked', 0)))} joins again asked)</span>")


def _ago(at: float, now: float) -> str:
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def render_body(view: dict[str, Any]) -> str:
    now = float(view.get("at") or time.time())
    out = [f"<p class=muted>asked node <b>{escape(str(view.get('asked')))}</b> at "
           f"{escape(time.strftime('%H:%M:%S', time.localtime(now)))}; primary: "
           f"<b>{escape(str(view.get('primary') or '(none serving)'))}</b></p>"]
    out.append("<h2>Nodes</h2><table id=nodes><tr><th>node</th><th>role</th><th>epoch</th>"
               "<th>ready</th><th>serving</th><th>position</th><th>pid</th><th>AMQP</th>"
               "<th>admin</th><th>elections</th><th>loop lag p99 / max</th><th>GC pause max</th>"
               "<th>alarms</th></tr>")
    for n in view.get("nodes") or []:
        role = str(n.get("role") or "?")
        admin = n.get("admin_url")
        link = f"<a href='{escape(admin)}/'>{escape(admin)}</a>" if admin else "–"
        pos = n.get("position")
        out.append(f"<tr data-node='{escape(str(n.get('name')))}'>"
                   f"<td><b>{escape(str(n.get('name')))}</b></td>"
                   f"<td class={escape(role.replace(' ', '-'))}>{escape(role)}</td>"
                   f"{_cell(n.get('epoch'), 'num')}<td>{_yes(n.get('ready'))}</td>"
                   f"<td>{_yes(n.get('serving'))}</td>"
                   f"{_cell('/'.join(map(str, pos)) if pos else None)}{_cell(n.get('pid'), 'num')}"
                   f"{_cell(n.get('amqp_url'))}<td>{link}</td>"
                   f"<td class=elections>{_elections(n.get('election'), now)}</td>"
                   f"<td class=loop>{_loop(n.get('loop'))}</td>"
                   f"<td class=gc>{_gc(n.get('gc'))}</td>"
                   f"<td class=alarms>{_alarms(n.get('alarms'))}</td></tr>")
    out.append("</table>")

    rep = view.get("replication")
    if rep:
        out.append(f"<h2>Replication</h2><p>seq {escape(str(rep.get('seq')))}, replicated "
                   f"{escape(str(rep.get('replicated')))}, confirms waiting "
                   f"{escape(str(rep.get('waiting_confirms')))}{_flow(rep)}"
                   f"{_replicate_changes(rep)}</p>"
                   "<table id=backups><tr>"
                   "<th>backup</th><th>state</th><th>acked</th><th>lag (events)</th>"
                   "<th>queues caught up</th></tr>")
        for name, b in sorted((rep.get("backups") or {}).items()):
            state = ("ready" if b.get("ready") else "timed out" if b.get("timed_out")
                     else "catching up")
            out.append(f"<tr><td>{escape(name)}</td><td>{escape(state)}</td>"
                       f"{_cell(b.get('acked'), 'num')}{_cell(b.get('lag'), 'num')}"
                       f"<td class=num>{escape(str(b.get('queues_caught_up')))} / "
                       f"{escape(str(b.get('queues')))}</td></tr>")
        if not rep.get("backups"):
            out.append("<tr><td colspan=5 class=muted>no backup joined</td></tr>")
        out.append("</table>")

    queues = view.get("queues")
    out.append(f"<h2>Queues <span class=muted>(on {escape(str(view.get('queues_from')))})</span>"
               "</h2>")
    if queues is None:
        out.append("<p class=muted>the primary did not answer</p>")
    elif not queues:
        out.append("<p class=muted>no queues</p>")
    else:
        out.append("<table id=queues><tr><th>vhost</th><th>queue</th><th>ready</th>"
                   "<th>unacked</th><th>consumers</th><th>in</th><th>out</th>"
                   "<th>backups caught up</th></tr>")
        for q in queues[:200]:
            backups = q.get("backups_caught_up")
            caught = ("–" if backups is None else ", ".join(
                f"{escape(b)} {'✓' if ok else '…'}" for b, ok in sorted(backups.items())) or "–")
            out.append(f"<tr>{_cell(q.get('vhost'))}{_cell(q.get('name'))}"
                       f"{_cell(q.get('messages_ready'), 'num')}"
                       f"{_cell(q.get('messages_unacked'), 'num')}"
                       f"{_cell(q.get('consumers'), 'num')}{_cell(q.get('published'), 'num')}"
                       f"{_cell(q.get('delivered'), 'num')}<td>{caught}</td></tr>")
        out.append("</table>")
        if len(queues) > 200:
            out.append(f"<p class=muted>and {len(queues) - 200} more (brokerha ctl queues)</p>")

    out.append("<h2>Recent failovers</h2>")
    failovers = view.get("failovers") or []
    if not failovers:
        out.append("<p class=muted id=failovers>none since these nodes started</p>")
    else:
        out.append("<table id=failovers><tr><th>when</th><th>event</th><th>node</th>"
                   "<th>epoch</th><th>details</th><th>seen by</th></tr>")
        for f in failovers:
            details = ", ".join(f"{k} {v}" for k, v in sorted(f.items())
                                if k not in ("at", "event", "node", "epoch", "seen_by"))
            out.append(f"<tr><td>{escape(_ago(float(f.get('at', now)), now))}</td>"
                       f"{_cell(f.get('event'))}{_cell(f.get('node'))}"
                       f"{_cell(f.get('epoch'), 'num')}{_cell(details or None)}"
                       f"{_cell(f.get('seen_by'))}</tr>")
        out.append("</table>")

    txlog = view.get("txlog") or {}
    out.append("<h2>TxLog</h2>")
    if txlog.get("running"):
        out.extend(_txlog_section(txlog))
    else:
        out.append(f"<p id=txlog>not running on this node <span class=muted>— "
                   f"{escape(str(txlog.get('reason', '')))}</span></p>")
    return "".join(out)


def _txlog_section(txlog: dict[str, Any]) -> list[str]:
    """This DC's master and each sync peer: synchronised position, link, membership, split."""
    sync = txlog.get("synchronised") or {}
    split = txlog.get("split")
    state = ("<span class=down>split</span> since position "
             f"{escape(str(txlog.get('split_at')))}" if split else "joined")
    if txlog.get("voting"):
        state += " — recovery vote under way"
    latency = txlog.get("latency_ms") or {}
    out = [f"<p id=txlog>master <b>{escape(str(txlog.get('node_id')))}</b>, generation "
           f"{escape(str(txlog.get('generation')))}, {state}; split recovery "
           f"{escape(str(txlog.get('split_recovery')))}; agreement p50/p99 "
           f"{escape(str(latency.get('p50')))}/{escape(str(latency.get('p99')))} ms</p>",
           "<table id=txlog-masters><tr><th>master</th><th>synchronised</th><th>link</th>"
           "<th>member</th><th>silent</th></tr>",
           f"<tr><td>{escape(str(txlog.get('node_id')))} (this DC)</td>"
           f"{_cell(sync.get('length'), 'num')}<td>—</td><td>{_yes(True)}</td><td>—</td></tr>"]
    for peer in txlog.get("peers") or []:
        silent = peer.get("silent_ms")
        out.append(f"<tr><td>{escape(str(peer.get('id')))}</td>"
                   f"{_cell(peer.get('synchronised'), 'num')}"
                   f"<td>{'up' if peer.get('connected') else '<span class=down>down</span>'}</td>"
                   f"<td>{_yes(peer.get('member'))}</td>"
                   f"{_cell(None if silent is None else f'{silent / 1000:.1f} s')}</tr>")
    out.append(f"</table><p class=muted>incoming {escape(str(txlog.get('incoming')))}, "
               f"applied {escape(str(txlog.get('applied')))}</p>")
    return out
