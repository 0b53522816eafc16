// brokerha's management UI: a page over RabbitMQ's management API (/api/..., management.py).
// No data lives here: every view is a call with the signed-in user's credentials.
(function () {
  "use strict";
  var REFRESH_MS = 5000;
  var AGE = 600; // seconds of history in the overview's charts
  var state = {auth: sessionStorage.getItem("brokerha-auth"), page: null, timer: null,
               sort: {}, charts: {}, users: {}};
  var $ = function (id) { return document.getElementById(id); };

  function esc(v) {
    return String(v === undefined || v === null ? "" : v).replace(/[&<>"']/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c];
    });
  }
  function enc(v) { return encodeURIComponent(v); }
  function num(v) { return v === undefined || v === null ? "" : Number(v).toLocaleString("en"); }

  function api(method, path, body) {
    var init = {method: method, headers: {"Authorization": state.auth}, cache: "no-store"};
    if (body !== undefined) {
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return fetch("/api/" + path, init).then(function (r) {
      return r.text().then(function (t) {
        var data = t ? JSON.parse(t) : null;
        if (!r.ok) {
          var err = new Error((data && (data.reason || data.error)) || r.status);
          err.status = r.status;
          throw err;
        }
        return data;
      });
    });
  }

  function say(text) {
    var m = $("message");
    m.textContent = text || "";
    m.hidden = !text;
  }

  // -- login ------------------------------------------------------------------------------

  function showLogin(error) {
    state.auth = null;
    sessionStorage.removeItem("brokerha-auth");
    clearInterval(state.timer);
    $("nav").hidden = true;
    $("page").innerHTML = "";
    $("login").hidden = false;
    $("login-error").textContent = error || "";
  }

  $("login").addEventListener("submit", function (e) {
    e.preventDefault();
    state.auth = "Basic " + btoa($("login-user").value + ":" + $("login-password").value);
    start().catch(function (err) { showLogin("Login refused: " + err.message); });
  });
  $("logout").addEventListener("click", function () { showLogin(""); });

  function start() {
    return api("GET", "whoami").then(function (me) {
      sessionStorage.setItem("brokerha-auth", state.auth);
      $("who").textContent = me.name;
      $("login").hidden = true;
      $("nav").hidden = false;
      return api("GET", "overview").then(function (o) {
        $("cluster").textContent = "cluster " + o.cluster_name;
        route();
      });
    });
  }

  // -- pages ------------------------------------------------------------------------------

  var pages = {overview: overview, queues: queues, exchanges: exchanges,
               connections: connections, channels: channels, vhosts: vhosts, admin: admin,
               policies: policies};

  function route() {
    var name = (location.hash || "#overview").slice(1);
    if (!pages[name]) name = "overview";
    if (state.page !== name) {
      state.page = name;
      state.charts = {};
      $("page").innerHTML = "";
    }
    document.querySelectorAll("nav a").forEach(function (a) {
      a.classList.toggle("active", a.dataset.page === name);
    });
    refresh();
    clearInterval(state.timer);
    state.timer = setInterval(refresh, REFRESH_MS);
  }
  window.addEventListener("hashchange", route);

  function refresh() {
    if (!state.auth) return;
    var name = state.page;
    pages[name]().then(function () { say(""); }).catch(function (err) {
      if (err.status === 401) { showLogin("Signed out: " + err.message); return; }
      say("Could not refresh " + name + ": " + err.message);
    });
  }

  // a part of the page that is re-rendered on every refresh, beside parts that stay
  function part(id) {
    var el = $(id);
    if (!el) {
      el = document.createElement("div");
      el.id = id;
      $("page").appendChild(el);
    }
    return el;
  }

  function once(id, html, bind) {
    if ($(id)) return;
    var el = part(id);
    el.innerHTML = html;
    if (bind) bind(el);
  }

  function table(id, columns, rows, rowAttrs) {
    var sort = state.sort[id];
    if (sort) {
      rows = rows.slice().sort(function (a, b) {
        var x = a[sort.key], y = b[sort.key];
        var c = (typeof x === "number" && typeof y === "number") ? x - y
          : String(x).localeCompare(String(y));
        return sort.desc ? -c : c;
      });
    }
    var head = columns.map(function (c) {
      return "<th" + (c.key ? ' class="sortable" data-sort="' + c.key + '"' : "") + ">" +
        esc(c.title) + "</th>";
    }).join("");
    var body = rows.map(function (r) {
      return "<tr " + (rowAttrs ? rowAttrs(r) : "") + ">" + columns.map(function (c) {
        var v = c.html ? c.html(r) : esc(c.key === undefined ? "" : r[c.key]);
        return "<td" + (c.num ? ' class="num"' : "") + ">" + v + "</td>";
      }).join("") + "</tr>";
    }).join("");
    var el = part(id);
    el.innerHTML = '<table data-table="' + id + '"><thead><tr>' + head + "</tr></thead><tbody>" +
      (body || '<tr><td colspan="' + columns.length + '" class="muted">none</td></tr>') +
      "</tbody></table>";
    el.querySelectorAll("th.sortable").forEach(function (th) {
      th.addEventListener("click", function () {
        var cur = state.sort[id];
        state.sort[id] = {key: th.dataset.sort, desc: cur && cur.key === th.dataset.sort ?
          !cur.desc : false};
        refresh();
      });
    });
    return el;
  }

  function chart(id, title, series, width) {
    var ch = state.charts[id];
    var xs = series[0], data = [xs].concat(series.slice(1).map(function (s) { return s.values; }));
    if (!ch) {
      var el = part(id);
      el.innerHTML = "<h2>" + esc(title) + "</h2>";
      ch = new uPlot({width: width || 520, height: 200,
        // the last AGE seconds, however few samples there are yet
        scales: {x: {time: true, range: function () {
          var now = Date.now() / 1000;
          return [now - AGE, now];
        }}},
        series: [{}].concat(
        series.slice(1).map(function (s) { return {label: s.label, stroke: s.color}; }))},
        data, el);
      state.charts[id] = ch;
    } else {
      ch.setData(data);
    }
  }

  function samples(details) { return (details && details.samples) || []; }

  // an HA member's campaigns by why it stood, its step-downs as primary by why
  // (cluster/election.py), the last campaign, late heartbeats
  function elections(e) {
    if (!e) return '<span class="muted">–</span>';
    function counts(c) {
      return Object.keys(c || {}).sort().filter(function (k) { return c[k] > 0; })
        .map(function (k) {
          return '<span data-reason="' + esc(k) + '">' + esc(k) + " " + esc(c[k]) + "</span>";
        }).join(", ");
    }
    var started = counts(e.elections), stepped = counts(e.stepdowns), out = [];
    out.push(started ? "stood: " + started : '<span class="muted">never stood</span>');
    if (stepped) out.push("stepped down: " + stepped);
    if (e.last_election) {
      var ago = Math.max(0, Date.now() / 1000 - e.last_election.at);
      out.push('<span class="muted">last: ' + esc(e.last_election.reason) + ", " +
        (ago < 120 ? ago.toFixed(0) + " s" : (ago / 60).toFixed(0) + " min") + " ago</span>");
    }
    if (e.heartbeats_late) out.push("late heartbeats: " + esc(e.heartbeats_late));
    return '<span data-elections="' + esc(JSON.stringify(e.elections || {})) + '">' +
      out.join("<br>") + "</span>";
  }

  function ms(seconds) {
    var v = Number(seconds || 0) * 1000;
    return (v < 10 ? v.toFixed(1) : v.toFixed(0)) + " ms";
  }

  // the event loop's lag over the last minute (node/loop_monitor.py): p99 / max, stalls
  function loopLag(l) {
    if (!l) return '<span class="muted">–</span>';
    return '<span data-loop-p99="' + esc(l.lag_p99) + '" data-loop-max="' + esc(l.lag_max) +
      '">' + ms(l.lag_p99) + " / " + ms(l.lag_max) + "</span>" +
      (l.stalls ? ' <span class="muted">(' + esc(l.stalls) + " stalls over 100 ms)</span>" : "");
  }

  // publisher flow control on a primary (broker/flow.py): held now, and by whose lag;
  // the holds so far and the seconds held in all
  function flowHolds(f) {
    if (!f) return '<span class="muted">–</span>';
    var now = f.publishers_held ? '<span class="down">held</span>' +
      (f.publishers_held_by ? " (" + esc(f.publishers_held_by) + ")" : "") : "no";
    return '<span data-flow-held="' + (f.publishers_held ? 1 : 0) + '" data-flow-holds="' +
      esc(f.publisher_holds) + '">' + now + ' <span class="muted">(' + esc(f.publisher_holds) +
      " holds, " + Number(f.publishers_held_seconds || 0).toFixed(1) + " s)</span></span>";
  }

  // ha-replicate changes of existing queues on a primary (docs/ha.md, "Replication"): the
  // queues whose change is not applied yet and the backups it waits for; the changes
  // applied and the joins again asked so far
  function replicateChanges(c) {
    if (!c) return '<span class="muted">–</span>';
    var now = "none pending";
    if (c.pending) {
      now = '<span class="joining" title="' + esc((c.queues || []).join("; ")) + '">' +
        esc(c.queues_pending) + " queues not applied</span> (joining again: " +
        esc(c.joining_again || "–") + "; to join again: " +
        esc((c.backups_to_join_again || []).join(", ") || "none") + ")";
    }
    return '<span data-replicate-pending="' + esc(c.pending ? c.queues_pending : 0) +
      '" data-replicate-applied="' + esc(c.applied_queues) + '" data-rejoins-asked="' +
      esc(c.joins_asked) + '">' + now + ' <span class="muted">(' + esc(c.applied_queues) +
      " applied, " + esc(c.joins_asked) + " joins again asked)</span></span>";
  }

  // the cyclic GC (node/gc_governor.py): the longest pause since start, collections by
  // generation, objects frozen out of its walk
  function gcPauses(g) {
    if (!g) return '<span class="muted">–</span>';
    var c = g.collections || [];
    return '<span data-gc-pause-max="' + esc(g.pause_seconds_max) + '">' +
      ms(g.pause_seconds_max) + '</span> <span class="muted">(collections ' + esc(c.join("/")) +
      ", " + num(g.frozen) + " frozen)</span>";
  }

  function overview() {
    return Promise.all([
      api("GET", "overview?lengths_age=" + AGE + "&msg_rates_age=" + AGE),
      api("GET", "nodes"),
      api("GET", "txlog").catch(function () { return null; })
    ]).then(function (got) {
      var o = got[0], nodes = got[1], txlog = got[2];
      var qt = o.queue_totals, ot = o.object_totals, ms = o.message_stats;
      part("totals").innerHTML = '<div class="cards">' + [
        ["Queued messages", qt.messages, "queued"], ["Ready", qt.messages_ready, "ready"],
        ["Unacknowledged", qt.messages_unacknowledged, "unacked"],
        ["Publish /s", ms.publish_details.rate, "publish-rate"],
        ["Deliver /s", ms.deliver_get_details.rate, "deliver-rate"],
        ["Connections", ot.connections, "connections"], ["Queues", ot.queues, "queues"],
        ["Consumers", ot.consumers, "consumers"]
      ].map(function (c) {
        return '<div class="card"><span class="muted">' + c[0] + '</span><b data-value="' +
          c[2] + '">' + num(c[1]) + "</b></div>";
      }).join("") + "</div>";
      // queued messages over time (samples come newest first)
      var ready = samples(qt.messages_ready_details).slice().reverse();
      var unacked = samples(qt.messages_unacknowledged_details).slice().reverse();
      var n = Math.min(ready.length, unacked.length);
      part("charts").className = "charts";
      if ($("charts").children.length === 0) {
        $("charts").innerHTML = '<div id="chart-queued"></div><div id="chart-rates"></div>';
      }
      chart("chart-queued", "Queued messages", [
        ready.slice(0, n).map(function (s) { return s.timestamp / 1000; }),
        {label: "ready", color: "#0a3d91", values: ready.slice(0, n).map(function (s) { return s.sample; })},
        {label: "unacked", color: "#a05a00", values: unacked.slice(0, n).map(function (s) { return s.sample; })}
      ]);
      // rates: the difference of consecutive counter samples over their time
      function rates(details) {
        var s = samples(details).slice().reverse(), out = [];
        for (var i = 1; i < s.length; i++) {
          var dt = (s[i].timestamp - s[i - 1].timestamp) / 1000;
          out.push({t: s[i].timestamp / 1000, v: dt > 0 ? Math.max(0, s[i].sample - s[i - 1].sample) / dt : 0});
        }
        return out;
      }
      var pub = rates(ms.publish_details), del = rates(ms.deliver_get_details),
          ack = rates(ms.ack_details);
      var m = Math.min(pub.length, del.length, ack.length);
      chart("chart-rates", "Message rates (/s)", [
        pub.slice(0, m).map(function (p) { return p.t; }),
        {label: "publish", color: "#05640a", values: pub.slice(0, m).map(function (p) { return p.v; })},
        {label: "deliver/get", color: "#0a3d91", values: del.slice(0, m).map(function (p) { return p.v; })},
        {label: "ack", color: "#7a1fa2", values: ack.slice(0, m).map(function (p) { return p.v; })}
      ]);
      part("nodes-title").innerHTML = "<h2>Nodes</h2>";
      table("nodes", [
        {title: "Node", key: "name"},
        {title: "Role", html: function (r) { var b = r.brokerha || {};
          return '<span class="' + esc(b.role) + '" data-role="' + esc(b.role) + '">' + esc(b.role) + "</span>"; }},
        {title: "Epoch", html: function (r) { return esc((r.brokerha || {}).epoch); }},
        {title: "Ready", html: function (r) { return (r.brokerha || {}).ready ? "yes" : "no"; }},
        {title: "Backups (acknowledged seq, lag)", html: function (r) {
          var b = (r.brokerha || {}).backups || {};
          return Object.keys(b).sort().map(function (k) {
            var x = b[k];
            return esc(k) + ": " + esc(x.acked) + (x.lag !== undefined ? " (lag " + esc(x.lag) + ")" : "") +
              (x.ready ? "" : " catching up");
          }).join("<br>"); }},
        {title: "Elections (why)", html: function (r) {
          return elections((r.brokerha || {}).election); }},
        {title: "Loop lag p99 / max (1 min)", html: function (r) {
          return loopLag((r.brokerha || {}).loop); }},
        {title: "Publishers held (flow)", html: function (r) {
          return flowHolds((r.brokerha || {}).flow); }},
        {title: "ha-replicate changes", html: function (r) {
          return replicateChanges((r.brokerha || {}).replicate_changes); }},
        {title: "GC pause max", html: function (r) {
          return gcPauses((r.brokerha || {}).gc); }},
        {title: "Alarms", html: function (r) {
          return (r.mem_alarm ? "memory " : "") + (r.disk_free_alarm ? "disk" : ""); }}
      ], nodes, function (r) { return 'data-node="' + esc(r.name) + '"'; });
      var shown = {};
      if (txlog && txlog.running) {
        ["master", "node", "members", "split", "peers", "global_queues"].forEach(function (k) {
          if (txlog[k] !== undefined) shown[k] = txlog[k];
        });
      }
      part("txlog").innerHTML = "<h2>TxLog</h2>" + (txlog && txlog.running ?
        '<pre data-txlog="running">' + esc(JSON.stringify(shown, null, 1)) + "</pre>" :
        '<p class="muted" data-txlog="off">' + esc(txlog ? txlog.reason : "unknown") + "</p>");
    });
  }

  function vhostOptions(vhosts) {
    return vhosts.map(function (v) { return "<option>" + esc(v.name) + "</option>"; }).join("");
  }

  function act(promise, done) {
    return promise.then(function (r) { say(""); if (done) done(r); refresh(); })
      .catch(function (err) { say(err.message); });
  }

  function queues() {
    return Promise.all([api("GET", "queues"), api("GET", "vhosts")]).then(function (got) {
      var list = got[0], vhosts = got[1];
      once("queue-forms",
        '<form class="inline" id="declare-queue"><b>Add a queue</b> ' +
        '<label>vhost <select name="vhost">' + vhostOptions(vhosts) + "</select></label>" +
        '<label>name <input name="name" required></label>' +
        '<label><input type="checkbox" name="durable" checked> durable</label>' +
        '<button type="submit">Add queue</button></form> ' +
        '<form class="inline" id="publish-queue"><b>Publish</b> ' +
        '<label>vhost <select name="vhost">' + vhostOptions(vhosts) + "</select></label>" +
        '<label>to queue <input name="queue" required></label>' +
        '<label>payload <input name="payload"></label>' +
        '<button type="submit">Publish message</button></form>',
        function (el) {
          el.querySelector("#declare-queue").addEventListener("submit", function (e) {
            e.preventDefault();
            var f = e.target;
            act(api("PUT", "queues/" + enc(f.vhost.value) + "/" + enc(f.name.value),
                    {durable: f.durable.checked}), function () { f.name.value = ""; });
          });
          el.querySelector("#publish-queue").addEventListener("submit", function (e) {
            e.preventDefault();
            var f = e.target;
            act(api("POST", "exchanges/" + enc(f.vhost.value) + "/amq.default/publish",
                    {routing_key: f.queue.value, payload: f.payload.value,
                     payload_encoding: "string", properties: {}}), function (r) {
              say(r.routed ? "" : "published, but no queue took it");
            });
          });
        });
      var rows = list.map(function (q) {
        return {vhost: q.vhost, name: q.name, ready: q.messages_ready,
                unacked: q.messages_unacknowledged, consumers: q.consumers,
                publish: ((q.message_stats || {}).publish_details || {}).rate || 0,
                deliver: ((q.message_stats || {}).deliver_get_details || {}).rate || 0,
                durable: q.durable};
      });
      table("queue-table", [
        {title: "Virtual host", key: "vhost"}, {title: "Name", key: "name"},
        {title: "Ready", key: "ready", num: true}, {title: "Unacked", key: "unacked", num: true},
        {title: "Consumers", key: "consumers", num: true},
        {title: "Publish /s", key: "publish", num: true},
        {title: "Deliver /s", key: "deliver", num: true},
        {title: "", html: function (r) {
          return '<button data-act="get">Get</button> <button data-act="purge">Purge</button> ' +
            '<button data-act="delete">Delete</button>'; }}
      ], rows, function (r) {
        return 'data-queue="' + esc(r.name) + '" data-vhost="' + esc(r.vhost) + '"';
      }).querySelectorAll("button[data-act]").forEach(function (b) {
        b.addEventListener("click", function () {
          var tr = b.closest("tr"), path = "queues/" + enc(tr.dataset.vhost) + "/" +
            enc(tr.dataset.queue);
          if (b.dataset.act === "get") {
            act(api("POST", path + "/get", {count: 1, ackmode: "ack_requeue_true",
                                             encoding: "auto", truncate: 50000}), function (got) {
              part("got").innerHTML = "<h2>Get from " + esc(tr.dataset.queue) + "</h2>" +
                (got.length ? got.map(function (m) {
                  return '<pre data-got="payload">' + esc(m.payload) + "</pre>" +
                    '<p class="muted">exchange ' + esc(m.exchange) + ", routing key " +
                    esc(m.routing_key) + ", redelivered " + esc(m.redelivered) +
                    " (put back)</p>";
                }).join("") : '<p class="muted" data-got="empty">the queue is empty</p>');
            });
          } else if (b.dataset.act === "purge") {
            act(api("DELETE", path + "/contents"));
          } else if (confirm("Delete queue " + tr.dataset.queue + "?")) {
            act(api("DELETE", path));
          }
        });
      });
    });
  }

  function exchanges() {
    return Promise.all([api("GET", "exchanges"), api("GET", "vhosts")]).then(function (got) {
      var list = got[0], vhosts = got[1];
      once("exchange-forms",
        '<form class="inline" id="declare-exchange"><b>Add an exchange</b> ' +
        '<label>vhost <select name="vhost">' + vhostOptions(vhosts) + "</select></label>" +
        '<label>name <input name="name" required></label>' +
        '<label>type <select name="type"><option>direct</option><option>fanout</option>' +
        "<option>topic</option><option>headers</option></select></label>" +
        '<button type="submit">Add exchange</button></form>',
        function (el) {
          el.querySelector("#declare-exchange").addEventListener("submit", function (e) {
            e.preventDefault();
            var f = e.target;
            act(api("PUT", "exchanges/" + enc(f.vhost.value) + "/" + enc(f.name.value),
                    {type: f.type.value, durable: true}), function () { f.name.value = ""; });
          });
        });
      table("exchange-table", [
        {title: "Virtual host", key: "vhost"},
        {title: "Name", html: function (r) { return esc(r.name || "(AMQP default)"); }},
        {title: "Type", key: "type"},
        {title: "Durable", html: function (r) { return r.durable ? "yes" : "no"; }},
        {title: "", html: function (r) {
          return r.name && r.name.indexOf("amq.") !== 0 ?
            '<button data-act="delete">Delete</button>' : ""; }}
      ], list, function (r) {
        return 'data-exchange="' + esc(r.name) + '" data-vhost="' + esc(r.vhost) + '"';
      }).querySelectorAll("button[data-act]").forEach(function (b) {
        b.addEventListener("click", function () {
          var tr = b.closest("tr");
          if (confirm("Delete exchange " + tr.dataset.exchange + "?")) {
            act(api("DELETE", "exchanges/" + enc(tr.dataset.vhost) + "/" +
                    enc(tr.dataset.exchange)));
          }
        });
      });
    });
  }

  function connections() {
    return api("GET", "connections").then(function (list) {
      table("connection-table", [
        {title: "Name", key: "name"}, {title: "User", key: "user"}, {title: "Virtual host", key: "vhost"},
        {title: "Channels", key: "channels", num: true}, {title: "State", key: "state"},
        {title: "TLS", html: function (r) { return r.ssl ? "yes" : "no"; }},
        {title: "Client", html: function (r) {
          var p = r.client_properties || {};
          return esc((p.product || "") + " " + (p.version || "")); }}
      ], list, function (r) { return 'data-connection="' + esc(r.name) + '"'; });
    });
  }

  function channels() {
    return api("GET", "channels").then(function (list) {
      table("channel-table", [
        {title: "Channel", key: "name"}, {title: "User", key: "user"},
        {title: "Virtual host", key: "vhost"},
        {title: "Consumers", key: "consumer_count", num: true},
        {title: "Unacked", key: "messages_unacknowledged", num: true},
        {title: "Prefetch", key: "prefetch_count", num: true},
        {title: "Mode", html: function (r) {
          return r.transactional ? "transactional" : (r.confirm ? "confirm" : ""); }}
      ], list, function (r) { return 'data-channel="' + esc(r.name) + '"'; });
    });
  }

  // a select's options from names, keeping what was chosen (the lists change under a form)
  function fill(select, names) {
    var chosen = select.value;
    select.innerHTML = names.map(function (n) { return "<option>" + esc(n) + "</option>"; })
      .join("");
    if (names.indexOf(chosen) >= 0) select.value = chosen;
  }
  function names(list, key) { return list.map(function (x) { return x[key || "name"]; }); }
  function submit(el, id, handler) {
    el.querySelector("#" + id).addEventListener("submit", function (e) {
      e.preventDefault();
      handler(e.target);
    });
  }
  function rowButtons(el, handler) {
    el.querySelectorAll("button[data-act]").forEach(function (b) {
      b.addEventListener("click", function () { handler(b.dataset.act, b.closest("tr").dataset); });
    });
  }
  function tagList(text) {
    return text.split(",").map(function (t) { return t.trim(); }).filter(Boolean).join(",");
  }

  // users (add, delete, password, tags) and their permissions (set, clear): administrators
  function admin() {
    return Promise.all([api("GET", "users"), api("GET", "permissions"), api("GET", "vhosts"),
                        api("GET", "topic-permissions")]).then(function (got) {
      var users = got[0], perms = got[1], vhosts = got[2], topics = got[3];
      var byName = {};
      users.forEach(function (u) { byName[u.name] = u; });
      part("users-title").innerHTML = "<h2>Users</h2>";
      once("user-forms",
        '<form class="inline" id="add-user"><b>Add a user</b> ' +
        '<label>name <input name="name" required></label>' +
        '<label>password <input name="password" type="password" autocomplete="new-password"></label>' +
        '<label>tags <input name="tags" placeholder="administrator, monitoring"></label>' +
        '<button type="submit">Add user</button></form> ' +
        '<form class="inline" id="set-password"><b>Change a password</b> ' +
        '<label>user <select name="user"></select></label>' +
        '<label>new password <input name="password" type="password" autocomplete="new-password" required></label>' +
        '<button type="submit">Set password</button></form> ' +
        '<form class="inline" id="set-tags"><b>Set tags</b> ' +
        '<label>user <select name="user"></select></label>' +
        '<label>tags <input name="tags"></label>' +
        '<button type="submit">Set tags</button></form>',
        function (el) {
          submit(el, "add-user", function (f) {
            var body = {tags: tagList(f.tags.value)};
            if (f.password.value) body.password = f.password.value;
            act(api("PUT", "users/" + enc(f.name.value), body), function () {
              f.name.value = ""; f.password.value = ""; f.tags.value = "";
            });
          });
          submit(el, "set-password", function (f) {
            var u = state.users[f.user.value];
            act(api("PUT", "users/" + enc(f.user.value),
                    {password: f.password.value, tags: u.tags.join(",")}),
                function () { f.password.value = ""; say("password of " + u.name + " changed"); });
          });
          submit(el, "set-tags", function (f) {
            var u = state.users[f.user.value];  // the password stays: its hash goes back
            act(api("PUT", "users/" + enc(f.user.value),
                    {password_hash: u.password_hash, hashing_algorithm: u.hashing_algorithm,
                     tags: tagList(f.tags.value)}), function () { f.tags.value = ""; });
          });
        });
      state.users = byName;
      fill($("set-password").user, names(users));
      fill($("set-tags").user, names(users));
      rowButtons(table("user-table", [
        {title: "Name", key: "name"},
        {title: "Tags", html: function (r) { return esc(r.tags.join(", ")); }},
        {title: "Password", html: function (r) { return r.password_hash ? "set" :
          '<span class="muted">none (no password login)</span>'; }},
        {title: "", html: function () { return '<button data-act="delete">Delete</button>'; }}
      ], users, function (r) { return 'data-user="' + esc(r.name) + '"'; }), function (act_, row) {
        if (confirm("Delete user " + row.user + "?")) act(api("DELETE", "users/" + enc(row.user)));
      });
      permissionsPart(perms, topics, users, vhosts);
    }).catch(function (err) {
      if (err.status === 401 && state.auth) {
        part("users-title").innerHTML = '<p class="muted" data-denied="users">' +
          esc(err.message) + ": users and permissions are for administrators.</p>";
        return;
      }
      throw err;
    });
  }

  function permissionsPart(perms, topics, users, vhosts) {
    once("permission-forms",
      '<h2>Permissions</h2><form class="inline" id="set-permission"><b>Set permissions</b> ' +
      '<label>user <select name="user"></select></label>' +
      '<label>vhost <select name="vhost"></select></label>' +
      '<label>configure <input name="configure" value=".*" size="8"></label>' +
      '<label>write <input name="write" value=".*" size="8"></label>' +
      '<label>read <input name="read" value=".*" size="8"></label>' +
      '<button type="submit">Set permission</button></form>',
      function (el) {
        submit(el, "set-permission", function (f) {
          act(api("PUT", "permissions/" + enc(f.vhost.value) + "/" + enc(f.user.value),
                  {configure: f.configure.value, write: f.write.value, read: f.read.value}));
        });
      });
    fill($("set-permission").user, names(users));
    fill($("set-permission").vhost, names(vhosts));
    rowButtons(table("permission-table", [
      {title: "User", key: "user"}, {title: "Virtual host", key: "vhost"},
      {title: "Configure", key: "configure"}, {title: "Write", key: "write"},
      {title: "Read", key: "read"},
      {title: "", html: function () { return '<button data-act="clear">Clear</button>'; }}
    ], perms, function (r) {
      return 'data-permission="' + esc(r.vhost + "/" + r.user) + '" data-user-name="' +
        esc(r.user) + '" data-vhost="' + esc(r.vhost) + '"';
    }), function (act_, row) {
      act(api("DELETE", "permissions/" + enc(row.vhost) + "/" + enc(row.userName)));
    });
    part("topic-title").innerHTML = "<h2>Topic permissions</h2>";
    rowButtons(table("topic-permission-table", [
      {title: "User", key: "user"}, {title: "Virtual host", key: "vhost"},
      {title: "Exchange", key: "exchange"}, {title: "Write", key: "write"},
      {title: "Read", key: "read"},
      {title: "", html: function () { return '<button data-act="clear">Clear</button>'; }}
    ], topics, function (r) {
      return 'data-topic-permission="' + esc(r.vhost + "/" + r.user) + '" data-user-name="' +
        esc(r.user) + '" data-vhost="' + esc(r.vhost) + '"';
    }), function (act_, row) {
      act(api("DELETE", "topic-permissions/" + enc(row.vhost) + "/" + enc(row.userName)));
    });
  }

  // virtual hosts (add, delete): administrators change them, the others see theirs
  function vhosts() {
    return api("GET", "vhosts").then(function (list) {
      once("vhost-forms",
        '<form class="inline" id="add-vhost"><b>Add a virtual host</b> ' +
        '<label>name <input name="name" required></label>' +
        '<label>description <input name="description"></label>' +
        '<button type="submit">Add virtual host</button></form>',
        function (el) {
          submit(el, "add-vhost", function (f) {
            act(api("PUT", "vhosts/" + enc(f.name.value), {description: f.description.value}),
                function () { f.name.value = ""; f.description.value = ""; });
          });
        });
      rowButtons(table("vhost-table", [
        {title: "Name", key: "name"}, {title: "Description", key: "description"},
        {title: "Messages", key: "messages", num: true},
        {title: "", html: function () { return '<button data-act="delete">Delete</button>'; }}
      ], list, function (r) { return 'data-vhost="' + esc(r.name) + '"'; }), function (a, row) {
        if (confirm("Delete virtual host " + row.vhost + " and everything in it?")) {
          act(api("DELETE", "vhosts/" + enc(row.vhost)));
        }
      });
      once("definitions-forms",
        '<h2>Definitions</h2><p class="muted">RabbitMQ\'s JSON (administrators): users, ' +
        "virtual hosts, permissions, policies, queues, exchanges, bindings.</p>" +
        '<form class="inline" id="export-definitions"><b>Export</b> ' +
        '<button type="submit">Download definitions</button> <a id="export-link" hidden ' +
        'download="definitions.json">definitions.json</a></form> ' +
        '<form class="inline" id="import-definitions"><b>Import</b> ' +
        '<input type="file" name="file" accept=".json,application/json" required> ' +
        '<button type="submit">Upload definitions</button></form>', definitionsForms);
    });
  }

  // GET /api/definitions saved as a file; a file POSTed to /api/definitions (definitions_file.py)
  function definitionsForms(el) {
    submit(el, "export-definitions", function () {
      act(api("GET", "definitions"), function (defs) {
        var text = JSON.stringify(defs, null, 1), link = $("export-link");
        if (link.href) URL.revokeObjectURL(link.href);
        link.href = URL.createObjectURL(new Blob([text], {type: "application/json"}));
        link.dataset.bytes = text.length;
        link.hidden = false;
        link.click();
      });
    });
    submit(el, "import-definitions", function (f) {
      f.file.files[0].text().then(function (text) {
        var defs;
        try { defs = JSON.parse(text); } catch (e) {
          say("the file is not JSON: " + e.message);
          return;
        }
        act(api("POST", "definitions", defs), function () {
          f.reset();
          say("definitions imported");
        });
      });
    });
  }

  // policies and operator policies (set, clear); policymakers and administrators change them
  var POLICY_KINDS = {policies: "policy", "operator-policies": "operator-policy"};

  function policies() {
    return Promise.all([api("GET", "policies"), api("GET", "vhosts"),
                        api("GET", "operator-policies").catch(function () { return []; })])
      .then(function (got) {
        once("policy-forms",
          '<form class="inline" id="set-policy"><b>Set a policy</b> ' +
          '<label>kind <select name="kind"><option value="policies">policy</option>' +
          '<option value="operator-policies">operator policy</option></select></label>' +
          '<label>vhost <select name="vhost"></select></label>' +
          '<label>name <input name="name" required></label>' +
          '<label>pattern <input name="pattern" required></label>' +
          '<label>apply to <select name="applyto"><option>all</option><option>queues</option>' +
          '<option>exchanges</option></select></label>' +
          '<label>priority <input name="priority" type="number" value="0" size="4"></label>' +
          '<label>definition <textarea name="definition" rows="2" cols="36" required ' +
          'placeholder=\'{"max-length": 1000, "message-ttl": 60000}\'></textarea></label>' +
          '<button type="submit">Set policy</button></form>',
          function (el) {
            submit(el, "set-policy", function (f) {
              var definition;
              try { definition = JSON.parse(f.definition.value); } catch (e) {
                say("the definition is not JSON: " + e.message);
                return;
              }
              act(api("PUT", f.kind.value + "/" + enc(f.vhost.value) + "/" + enc(f.name.value),
                      {pattern: f.pattern.value, "apply-to": f.applyto.value,
                       priority: Number(f.priority.value || 0), definition: definition}),
                  function () { f.name.value = ""; });
            });
          });
        fill($("set-policy").vhost, names(got[1]));
        [["policies", got[0]], ["operator-policies", got[2]]].forEach(function (k) {
          part(k[0] + "-title").innerHTML = "<h2>" + (k[0] === "policies" ? "Policies" :
            "Operator policies") + "</h2>";
          rowButtons(table(k[0] + "-table", [
            {title: "Virtual host", key: "vhost"}, {title: "Name", key: "name"},
            {title: "Pattern", key: "pattern"}, {title: "Apply to", key: "apply-to"},
            {title: "Priority", key: "priority", num: true},
            {title: "Definition", html: function (r) {
              return "<code>" + esc(JSON.stringify(r.definition)) + "</code>"; }},
            {title: "", html: function () { return '<button data-act="clear">Clear</button>'; }}
          ], k[1], function (r) {
            return "data-" + POLICY_KINDS[k[0]] + '="' + esc(r.vhost + "/" + r.name) +
              '" data-vhost="' + esc(r.vhost) + '" data-name="' + esc(r.name) + '"';
          }), function (a, row) {
            act(api("DELETE", k[0] + "/" + enc(row.vhost) + "/" + enc(row.name)));
          });
        });
      });
  }

  if (state.auth) {
    start().catch(function () { showLogin(""); });
  } else {
    showLogin("");
  }
})();
