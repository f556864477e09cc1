// The relay dashboard: polls GET /api/status (a StatusReport, toolkit/wire/protocol/status.py) and renders it.
//
// No framework and no external requests: the relay serves this file, and an observer may sit on a
// network that only reaches the relay. Everything that came over the network (peer names, HF
// usernames) is written with textContent, never innerHTML: a volunteer picks their own name.
"use strict";

const POLL_MS = 1500;          // one StatusReport every 1.5 s is cheap for the relay
const HIDDEN_POLL_MS = 6000;   // a background tab still updates, just less often
const MAX_BACKOFF_MS = 15000;  // a relay answering with errors (overloaded) is retried at most this far apart
const TIMEOUT_MS = 5000;       // a hung request counts as a failure, so the banner shows
const HISTORY = 600;           // client-side samples/s history points kept (~15 min)
const RATE_WINDOW = 5;         // rounds per throughput point: one round alone is too spiky

const $ = (id) => document.getElementById(id);
const reportedHistory = [];    // [server unix seconds, the trainers' bounded self-reports, summed]
let clockOffsetS = 0;          // server clock - browser clock, from the response's Date header
let failures = 0;             // consecutive polls the relay answered with an error status

// --- formatting ---------------------------------------------------------------------------------
const intFmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
const fmt = {
  int: (n) => (n === null || n === undefined ? "–" : intFmt.format(n)),
  rate: (n) => (n === null || n === undefined ? "–" : n >= 100 ? intFmt.format(n) : n.toFixed(1)),
  loss: (n) => (n === null || n === undefined ? "–" : n.toPrecision(4)),
  secs: (s) => {
    if (s === null || s === undefined) return "–";
    if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
    return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  },
  pct: (f) => `${(100 * f).toFixed(f < 0.1 ? 1 : 0)} %`,
  // task and batch times are often well under a second: milliseconds there, fmt.secs above
  dur: (s) => (s === null || s === undefined ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : fmt.secs(s)),
  bytes: (n) => {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
    return `${i === 0 ? intFmt.format(n) : n.toFixed(n < 10 ? 1 : 0)} ${units[i]}`;
  },
  clock: (unixS) => new Date((unixS - clockOffsetS) * 1000).toLocaleTimeString("en-GB"),
};

function el(tag, text, attrs = {}) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

function fillTable(table, rows, emptyId = null) {
  table.tBodies[0].replaceChildren(...rows);
  if (emptyId) $(emptyId).hidden = rows.length > 0;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = cell instanceof Node ? cell : el("td", cell);
    tr.append(td);
  }
  return tr;
}

const num = (text) => el("td", text, { class: "num" });

// --- polling ------------------------------------------------------------------------------------
async function poll() {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), TIMEOUT_MS);
  try {
    const res = await fetch("/api/status", { cache: "no-store", signal: abort.signal });
    if (!res.ok) {
      failures += 1;  // the relay is up but struggling: back off, so observers do not add to its load
      throw new Error(`HTTP ${res.status}`);
    }
    const serverDate = Date.parse(res.headers.get("Date") || "");
    if (!Number.isNaN(serverDate)) clockOffsetS = (serverDate - Date.now()) / 1000;
    const status = await res.json();
    failures = 0;
    setConnected(true);
    render(status);
  } catch (err) {
    // A relay that is down or restarting costs nothing to ask again: keep the normal cadence, so the
    // page is live again within one poll of the relay coming back.
    setConnected(false, err.name === "AbortError" ? "no answer" : err.message);
  } finally {
    clearTimeout(timer);
    setTimeout(poll, nextPollMs());
  }
}

function nextPollMs() {
  const base = document.hidden ? HIDDEN_POLL_MS : POLL_MS;
  return failures ? Math.min(MAX_BACKOFF_MS, base * 2 ** failures) : base;
}

function setConnected(ok, reason = "") {
  document.body.classList.toggle("stale", !ok);
  const banner = $("unreachable");
  if (ok) {
    banner.hidden = true;
    $("connection").textContent = "live";
    $("updated").textContent = new Date().toLocaleTimeString("en-GB");
    return;
  }
  banner.textContent = `Cannot reach the relay (${reason}). Showing the last data received; ` +
    `retrying every ${(nextPollMs() / 1000).toFixed(1)} s.`;
  banner.hidden = false;
  $("connection").textContent = "relay unreachable";
}

// --- rendering ----------------------------------------------------------------------------------
function render(s) {
  document.title = `${s.run_name} · step ${s.step} · collabtrain`;
  $("run-name").textContent = s.run_name;
  $("finished").hidden = !s.finished;
  $("auth-mode").textContent = s.auth_mode;
  $("auth-mode").className = `badge ${s.auth_mode === "open" ? "warn" : "ok"}`;
  $("open-warning").hidden = s.auth_mode !== "open";
  renderCards(s);
  renderRound(s);
  renderCharts(s);
  renderSamples(s);
  renderPeers(s);
  renderLeaderboard(s);
  renderPlan(s);
  renderExperts(s);
  renderPipeline(s);
  renderConfig(s);
}

/** run.mode = "local_sgd": "H = 30 inner steps", "60 s of inner training", or both. */
function innerBudget(l) {
  const steps = l.inner_steps ? `H = ${fmt.int(l.inner_steps)} inner steps` : "";
  const secs = l.inner_seconds ? `${fmt.secs(l.inner_seconds)} of inner training` : "";
  return steps && secs ? `${steps} or ${secs}` : steps || secs;
}

/** A run whose step is not a round of samples (a pipeline's batch): its progress comes in its own unit. */
const stepWord = (s) => (s.progress ? "batch" : "round");

function renderCards(s) {
  const local = s.local_sgd;  // a low-bandwidth run: the step is the outer round
  $("step-label").textContent = local ? "Outer round" : "Global step";
  $("step").textContent = fmt.int(s.step);
  $("step").dataset.value = s.step;
  $("total-steps").textContent = s.total_steps ? `of ${fmt.int(s.total_steps)}` : "no step limit";
  $("inner-budget").hidden = !local;
  $("inner-budget").textContent = local ? innerBudget(local) : "";
  $("loss").textContent = fmt.loss(s.loss);
  // The relay's own measurement (samples its rounds applied over their time); the peers' reports beside it, as such.
  $("samples-per-s").textContent = s.samples_per_s_rounds ? fmt.rate(s.samples_per_s) : "–";
  $("samples-per-s").dataset.value = String(s.samples_per_s);
  const unit = stepWord(s);
  const plural = (n) => (n === 1 ? unit : unit === "batch" ? "batches" : `${unit}s`);
  $("samples-per-s-basis").textContent = s.samples_per_s_rounds
    ? `measured over the last ${s.samples_per_s_rounds} ${plural(s.samples_per_s_rounds)}`
    : `measured once two ${plural(2)} finished`;
  // A pipeline's stage workers report no samples/s of their own: only the relay's measurement applies.
  $("samples-per-s-reported").hidden = !!s.progress;
  $("samples-per-s-reported").textContent = s.progress ? "" : `trainers report ${fmt.rate(s.reported_samples_per_s)}`;
  $("num-peers").textContent = fmt.int(s.num_peers);
  const t = s.traffic;
  for (const [id, value] of [["bytes-up", t && t.up_bytes_per_sample], ["bytes-down", t && t.down_bytes_per_sample]]) {
    $(id).textContent = fmt.bytes(value);
    $(id).dataset.value = value === null || value === undefined ? "" : String(value);
  }
  // A pipeline's bytes by what they carry: stage parameters and gradients outweigh the boundaries.
  const parts = s.pipeline && s.pipeline.traffic;
  const per = (n) => (t && t.samples ? fmt.bytes(n / t.samples) : "–");
  $("bytes-per-sample").title = parts ? `per sample: boundaries ${per(parts.boundaries_up)} up, ` +
    `${per(parts.boundaries_down)} down; stage gradients ${per(parts.stage_gradients_up)} up; ` +
    `stage parameters ${per(parts.stage_params_down)} down` : "";
  // Steps the relay refused to publish (they would have made parameters non-finite): the run kept its last version.
  const refused = (s.refused_steps || 0) + (s.pipeline ? s.pipeline.refused_steps || 0 : 0);
  $("refused-steps").hidden = !refused;
  $("refused-steps").dataset.value = String(refused);
  $("refused-steps").textContent = refused ? `${fmt.int(refused)} step${refused === 1 ? "" : "s"} refused: ` +
    "they would have made the parameters non-finite; the last good version stays published" : "";
  $("busy-card").hidden = !local;
  if (!local) return;
  $("busy-fraction").textContent = local.busy_fraction === null ? "–" : fmt.pct(local.busy_fraction);
  $("inner-last-round").textContent = local.inner_steps_last_round === null ? "no outer round yet"
    : `${local.inner_steps_last_round.toFixed(1)} inner steps per peer in the last outer round`;
}

function renderRound(s) {
  const bar = $("round-progress");
  const progress = s.progress;  // a pipeline's batch: micro-batch tasks done of the batch's
  $("round-label").textContent = progress ? "Current batch" : "Current round";
  bar.max = progress ? Math.max(progress.total, 1) : s.target_batch;
  bar.value = progress ? progress.done : Math.min(s.samples_accumulated, s.target_batch);
  bar.dataset.done = progress ? String(progress.done) : String(s.samples_accumulated);
  bar.dataset.total = progress ? String(progress.total) : String(s.target_batch);
  let text;
  if (s.finished) {
    text = "The run reached its last step.";
  } else if (progress) {
    const eta = progress.eta_s === null || progress.eta_s === undefined ? "ETA once a batch was measured"
      : `ETA ${fmt.secs(progress.eta_s)}`;
    text = progress.done >= progress.total
      ? `All ${fmt.int(progress.total)} micro-batch ${progress.unit} of step ${s.step + 1} done; ` +
        `its stage gradients are uploading (${eta}).`
      : `${fmt.int(progress.done)} of ${fmt.int(progress.total)} micro-batch ${progress.unit} ` +
        `for step ${s.step + 1} (${eta}).`;
  } else if (s.round) {
    const r = s.round;
    text = `${s.local_sgd ? "Outer" : "Averaging"} round for step ${r.step}: ` +
      `${r.received_peers} of ${r.expected_peers} peers uploaded, ` +
      `deadline in ${fmt.secs(r.deadline_in_s)}.`;
  } else {
    const eta = s.eta_s === null ? "waiting for peers" : `ETA ${fmt.secs(s.eta_s)}`;
    text = `${fmt.int(s.samples_accumulated)} of ${fmt.int(s.target_batch)} samples for step ${s.step + 1} (${eta}).`;
  }
  $("round-text").textContent = text;
  // What the last step really applied: a round opens at the target, and each peer then adds the
  // micro-batch it was computing, so a step may apply more than the target (stated, not hidden).
  const last = (s.recent_rounds || []).at(-1);
  $("last-applied").textContent = last ? `Step ${last.step} applied ${fmt.int(last.samples)} of target ` +
    `${fmt.int(s.target_batch)} samples from ${fmt.int(last.contributors)} peers.` : "";
}

/** Samples/s over a sliding window of finished rounds: [finalized_at, rate]. */
function roundRates(rounds) {
  const points = [];
  for (let i = 1; i < rounds.length; i++) {
    const k = Math.min(RATE_WINDOW, i);
    const dt = rounds[i].finalized_at - rounds[i - k].finalized_at;
    let samples = 0;
    for (let j = i - k + 1; j <= i; j++) samples += rounds[j].samples;
    if (dt > 0) points.push([rounds[i].finalized_at, samples / dt]);
  }
  return points;
}

function renderCharts(s) {
  const rounds = s.recent_rounds || [];
  const lossPoints = rounds.filter((r) => r.loss !== null).map((r) => [r.step, r.loss]);
  // Chance level (and the demo text's unigram entropy): dashed lines, so a newcomer sees where the loss stands.
  const refs = s.loss_references || [];
  // [evaluation] runs: the held-out validation loss per evaluated version, on the same step axis.
  const evals = s.evaluations || [];
  const valPoints = evals.map((e) => [e.step, e.loss]);
  lineChart($("loss-chart"), [{ cls: "loss", points: lossPoints }, { cls: "validation", points: valPoints }],
    { x: (v) => fmt.int(v), y: fmt.loss, empty: "No finished round yet.", refs });
  $("loss-chart").dataset.validationPoints = String(valPoints.length);
  $("validation-key").hidden = !valPoints.length;
  const refText = refs.map((r) => `${r.label} = ${fmt.loss(r.value)}`).join("; ");
  const last = evals.at(-1);
  const valText = last ? `Validation loss ${fmt.loss(last.loss)} at step ${last.step}` +
    (last.perplexity !== null && last.perplexity !== undefined ? `, perplexity ${fmt.loss(last.perplexity)}` : "") +
    (last.accuracy !== null && last.accuracy !== undefined ? `, accuracy ${fmt.pct(last.accuracy)}` : "") + ". " : "";
  $("loss-summary").textContent = (lossPoints.length
    ? `${lossPoints.length} rounds shown; first loss ${fmt.loss(lossPoints[0][1])}, ` +
      `latest ${fmt.loss(lossPoints[lossPoints.length - 1][1])} at step ${lossPoints[lossPoints.length - 1][0]}. `
    : "") + valText + (refText ? `References: ${refText}.` : "");

  if (!s.progress) reportedHistory.push([Date.now() / 1000 + clockOffsetS, s.reported_samples_per_s || 0]);
  if (reportedHistory.length > HISTORY) reportedHistory.shift();
  $("reported-key").hidden = !!s.progress;  // a pipeline's workers report no samples/s of their own
  const measured = roundRates(rounds);
  $("throughput-chart").dataset.roundsRate = measured.length ? String(measured.at(-1)[1]) : "";
  lineChart($("throughput-chart"),
    [{ cls: "rounds", points: measured }, { cls: "reported", points: reportedHistory }],
    { x: fmt.clock, y: fmt.rate, yFromZero: true, empty: "Waiting for data." });
}

/** "What the model says now": the fixed prompts answered by the last evaluated version. */
function renderSamples(s) {
  const last = (s.evaluations || []).at(-1);
  const samples = last ? last.samples || [] : [];
  $("samples-panel").hidden = !samples.length;
  if (!samples.length) return;
  $("samples-step").textContent = fmt.int(last.step);
  $("samples-step").dataset.value = last.step;
  fillTable($("samples"), samples.map((x) => {
    const answer = el("td", null, { class: `answer ${x.kind}` });
    if (x.kind === "fill-mask") {  // one token per span: a token may itself be a comma
      answer.append(...x.tokens.flatMap((t, i) => [el("span", t, { class: "token" }),
        el("small", ` ${fmt.pct(x.scores[i])} `, { class: "score" })]));
    } else {
      answer.append(el("span", x.output, { class: "token" }));
      if (x.scores.length) answer.append(el("small", ` ${fmt.pct(x.scores[0])}`, { class: "score" }));
    }
    return row([el("td", x.prompt, { class: "prompt" }), answer]);
  }));
}

function renderPeers(s) {
  const peers = s.peers.filter((p) => p.online !== false).sort((a, b) => a.name.localeCompare(b.name));
  const local = s.local_sgd;  // local SGD runs: each peer's inner steps (of H) and busy fraction
  for (const th of $("peers").querySelectorAll("th.local-sgd")) th.hidden = !local;
  const staged = !!s.progress;  // pipeline runs: the tasks the relay accepted from each stage worker
  for (const th of $("peers").querySelectorAll("th.pipeline")) th.hidden = !staged;
  const taskCells = (p) => !staged ? [] : [p.role === "stage_worker"
    ? el("td", fmt.int(p.tasks_done || 0), { class: "num tasks" }) : notApplicable(p)];
  const H = local && local.inner_steps ? ` of ${fmt.int(local.inner_steps)}` : "";
  const localCells = (p) => !local ? [] : [
    el("td", `${fmt.int(p.inner_steps)}${H}`, { class: "num inner-steps" }),
    el("td", p.busy_fraction === null || p.busy_fraction === undefined ? "not yet" : fmt.pct(p.busy_fraction),
      { class: "num busy" }),
  ];
  fillTable($("peers"), peers.map((p) => row([
    el("td", p.name, { title: p.peer_id }),
    p.username,
    el("td", roleText(p), { class: `role ${p.role || "trainer"}` }),
    ...roleCells(p),
    ...taskCells(p),
    num(`${fmt.secs(p.last_seen_s)} ago`),
    ...(p.role === "trainer" || !p.role ? [num(p.first_contribution_s === null || p.first_contribution_s === undefined
      ? "not yet" : fmt.secs(p.first_contribution_s))] : [notApplicable(p)]),
    ...localCells(p),
  ])), "peers-empty");
}

const ROLES = { trainer: "trainer", expert_host: "expert host", stage_worker: "stage worker" };

/** "trainer", "expert host · 16 experts", "stage worker · stage 1". */
function roleText(p) {
  const role = ROLES[p.role] || ROLES.trainer;
  if (p.role === "expert_host") return `${role} · ${fmt.int(p.experts_hosted || 0)} expert${p.experts_hosted === 1 ? "" : "s"}`;
  if (p.role === "stage_worker") return p.stage === null || p.stage === undefined ? `${role} · no stage yet`
    : `${role} · stage ${p.stage}`;
  return role;
}

/** A cell for a figure the peer's role does not have (an expert host trains nothing). */
function notApplicable(p) {
  return el("td", "–", { class: "num na", title: `not applicable to a ${ROLES[p.role] || p.role}` });
}

/** Device, precision, samples/s (reported) and samples contributed: what a trainer has; an expert
 * host only hosts; a stage worker reports no samples/s, and contributed the samples the relay
 * credited it as batches committed (what the leaderboard counts). */
function roleCells(p) {
  if (p.role === "expert_host") return [notApplicable(p), notApplicable(p), notApplicable(p), notApplicable(p)];
  const device = [p.device || "–", p.precision || "–"];
  if (p.role === "stage_worker") {
    return [...device, notApplicable(p), el("td", fmt.int(p.samples_contributed), { class: "num contributed" })];
  }
  const rate = el("td", p.samples_per_s_capped ? `≤ ${fmt.rate(p.samples_per_s)}` : fmt.rate(p.samples_per_s),
    { class: `num reported${p.samples_per_s_capped ? " capped" : ""}` });
  if (p.samples_per_s_capped) rate.title = "capped: the peer reported more than 10x the rate its progress reports grew";
  return [...device, rate, el("td", fmt.int(p.samples_contributed), { class: "num contributed" })];
}

function renderLeaderboard(s) {
  const entries = s.leaderboard || [];
  const total = entries.reduce((acc, e) => acc + e.samples, 0) || 1;
  fillTable($("leaderboard"), entries.map((e, i) => {
    const share = el("td");
    const meter = el("meter", null, { min: "0", max: "1", value: String(e.samples / total),
      "aria-label": `${e.username}: ${fmt.pct(e.samples / total)} of all samples` });
    share.append(meter, ` ${fmt.pct(e.samples / total)}`);
    return row([num(i + 1), e.username, num(fmt.int(e.samples)), num(fmt.int(e.rounds)), num(e.peers_online), share]);
  }), "leaderboard-empty");
}

function renderPlan(s) {
  const plan = s.plan;
  $("plan-panel").hidden = !plan;  // a run with no averaging (a pipeline) has no plan
  if (!plan) return;
  const slices = plan ? plan.slices : [];
  $("plan-summary").textContent = plan
    ? `Plan ${plan.version}: ${slices.length} aggregator${slices.length === 1 ? "" : "s"}` +
      (plan.steps_per_s ? `, predicted ${plan.steps_per_s.toFixed(2)} steps/s.` : ".")
    : "No plan published yet.";
  $("plan-bar").replaceChildren(...slices.map((sl, i) => {
    const part = el("div", sl.fraction >= 0.12 ? sl.name : "", {
      class: `slice c${i % 6}`, title: `${sl.name}: [${sl.start}, ${sl.end}) ${fmt.pct(sl.fraction)}` });
    part.style.flexGrow = String(Math.max(sl.end - sl.start, 1));
    return part;
  }));
  fillTable($("plan"), slices.map((sl, i) => {
    const name = el("td");
    name.append(el("span", null, { class: `swatch c${i % 6}`, "aria-hidden": "true" }), sl.name);
    if (sl.aggregator_id !== sl.name) name.title = sl.aggregator_id;
    return row([name, num(fmt.int(sl.end - sl.start)), num(`${fmt.int(sl.start)}–${fmt.int(sl.end)}`),
      num(fmt.pct(sl.fraction))]);
  }));
}

/** Runs with mixture-of-experts layers: how many experts have a host, the call rate and failures. */
function renderExperts(s) {
  const e = s.experts;
  $("experts-panel").hidden = !e;
  if (!e) return;
  $("experts-summary").textContent = `${fmt.int(e.live)} of ${fmt.int(e.total)} experts live, ` +
    `${fmt.rate(e.calls_per_s)} calls/s, ${fmt.pct(e.failure_rate)} failed (last minute), ` +
    `${fmt.int(e.queued_rows)} rows queued.` + expertChecks(e.trust);
  const names = Object.fromEntries((s.peers || []).map((p) => [p.peer_id, p.name]));
  const hosts = Object.entries(e.experts_per_host || {}).sort((a, b) => b[1] - a[1]);
  fillTable($("experts"), hosts.map(([peer, n]) => row([names[peer] || peer.slice(0, 8), num(fmt.int(n))])));
}

/** The relay's spot checks of expert hosts ([moe] check_share): one sentence, empty when off. */
function expertChecks(t) {
  if (!t) return "";
  const banned = (t.bans || []).length;
  return ` Checks: ${fmt.int(t.checks)} (${fmt.int(t.agreed)} agreed, ${fmt.int(t.disagreed)} disagreed, ` +
    `${fmt.int(t.unverifiable)} unverifiable), ${fmt.int(banned)} host${banned === 1 ? "" : "s"} banned` +
    ((t.suspects || []).length ? `, ${fmt.int(t.suspects.length)} suspect.` : ".");
}

const COUNTED_ROUNDS = 5;  // the Pipeline panel's "last rounds": enough to see a pattern, short enough to read

/** Pipeline runs ([pipeline]): the stages and their workers, the batch in flight, the boundaries
 * the relay holds, and the planner's predicted time per batch beside the measured one. */
function renderPipeline(s) {
  const p = s.pipeline;
  $("pipeline-panel").hidden = !p;
  if (!p) return;
  $("pipeline-summary").textContent = `Batch ${fmt.int(p.batch)}: ${fmt.int(p.finished)} of ` +
    `${fmt.int(p.microbatches)} micro-batches finished` +
    (p.round_open ? "; its round is open (every stage uploads its gradient)." : ".");
  $("pipeline-summary").dataset.finished = p.finished;
  $("pipeline-progress").max = Math.max(p.microbatches, 1);
  $("pipeline-progress").value = p.finished;

  const predicted = $("pipeline-predicted");
  const known = p.predicted_batch_s !== null && p.predicted_batch_s !== undefined;
  predicted.textContent = known ? fmt.dur(p.predicted_batch_s) : "—";
  predicted.title = known ? "the planner's time model (the paper's Eq. 1-3) on the workers' measured speeds"
    : "the planner predicts it once workers are measured";
  $("pipeline-measured").textContent = p.measured_batch_s === null ? "not yet (no batch finished)"
    : fmt.dur(p.measured_batch_s);
  $("pipeline-boundary").textContent = `${fmt.bytes(p.boundary_memory_bytes)} in memory, ` +
    `${fmt.bytes(p.boundary_spilled_bytes)} spilled to disk, ` +
    (p.boundary_bytes_per_sample === null ? "– per sample" : `${fmt.bytes(p.boundary_bytes_per_sample)} per sample`);
  const many = (n, word) => `${fmt.int(n)} ${word}${n === 1 ? "" : "s"}`;
  $("pipeline-recovery").textContent = `${many(p.redispatched, "task")} re-dispatched, ` +
    `${many(p.redone, "stage gradient")} recomputed, ${many(p.refused_results, "result")} refused, ` +
    `${many(p.cut_uploads || 0, "upload")} cut at the hold deadline`;
  renderWasted(p);
  renderTrust(p.trust, many);

  const rounds = (p.counted || []).slice(-COUNTED_ROUNDS);
  const exact = rounds.every((r) => r.every((n) => n === s.target_batch));
  const counted = $("pipeline-counted");
  counted.textContent = !rounds.length ? "no round closed yet"
    : exact ? `every stage counted exactly the batch's ${fmt.int(s.target_batch)} samples in ` +
      (rounds.length === 1 ? "the last round" : `each of the last ${rounds.length} rounds`)
    : `uneven: a stage counted other than the batch's ${fmt.int(s.target_batch)} samples (see the table)`;
  counted.className = rounds.length && !exact ? "warn" : "";

  const names = Object.fromEntries((s.peers || []).map((peer) => [peer.peer_id, peer.name]));
  fillTable($("pipeline-stages"), p.stages.map((st) => {
    const workers = el("td", null, { class: "workers" });
    if (!st.workers.length) workers.append(el("span", "none", { class: "hint" }));
    st.workers.forEach((id, i) =>
      workers.append(i ? ", " : "", el("span", names[id] || id.slice(0, 8), { title: id })));
    return row([`Stage ${st.stage}`, num(`${st.layers[0]}–${st.layers[1]}`), num(fmt.int(st.params)), workers,
      num(fmt.int(st.queued)), num(fmt.int(st.leased)), num(fmt.dur(st.lease_s)),
      num(st.task_s === null ? "not yet" : fmt.dur(st.task_s)),
      num(rounds.map((r) => fmt.int(r[st.stage])).join(" · ") || "–")]);
  }));
}

/** Spot checks of the workers' results ([pipeline] check_share): how many, what they found, who was banned. */
function renderTrust(t, many) {
  const out = $("pipeline-trust");
  if (!t || !t.check_share) {
    out.textContent = "not checked (pipeline.check_share = 0)";
    out.className = "";
    return;
  }
  const bans = t.bans || [];
  const probation = t.probation ? `; new workers: first ${fmt.int(t.probation)} checks at a raised share` : "";
  out.textContent = `${many(t.checks, "check")} (${fmt.int(Math.round(t.check_share * 100))}% of results${probation}): ` +
    `${fmt.int(t.agreed)} agreed, ${fmt.int(t.disagreed)} disagreed, ${fmt.int(t.refereed)} computed by the relay` +
    `; ${many(t.gradient_audits || 0, "stage-gradient upload")} audited (${fmt.int(t.gradient_audits_agreed || 0)} agreed, ` +
    `${fmt.int(t.gradient_lies || 0)} refused, ${fmt.int(t.gradient_audits_unserved || 0)} unserved)` +
    (bans.length ? `; ${many(bans.length, "worker")} banned for wrong results` : "; nobody banned") +
    ((t.on_probation || []).length ? `; ${many(t.on_probation.length, "worker")} on probation` : "") +
    rollbackSentence(t.rollbacks || [], many);
  out.title = bans.map((b) => `${b.worker.slice(0, 8)} (batch ${b.batch}): ${b.reason}`).join("\n") ||
    `tolerance ${t.tolerance}, largest distance between agreeing results ${t.max_agreeing_distance}`;
  out.className = bans.length ? "warn" : "";
}

/** What late bans undid: rollbacks to an earlier version, and bans too late to undo ([pipeline] rollback_batches). */
function rollbackSentence(rollbacks, many) {
  const done = rollbacks.filter((r) => r.outcome === "rolled back");
  const late = rollbacks.filter((r) => r.outcome === "too late");
  const last = done[done.length - 1];
  return (done.length ? `; ${many(done.length, "rollback")} (last to version ${fmt.int(last.to_version)}, ` +
    `${fmt.int(last.batches_undone)} batch${last.batches_undone === 1 ? "" : "es"} undone, ` +
    `${fmt.int(last.batches_replayed || 0)} replayed)` : "") +
    (late.length ? `; ${many(late.length, "ban")} too late to roll back` : "");
}

/** Work each batch paid for twice: the batch in flight, the last committed ones, and the run's totals. */
function renderWasted(p) {
  const batches = [...(p.wasted || []).slice(-COUNTED_ROUNDS)].reverse();
  const cells = (w) => [num(fmt.int(w.redispatched)), num(fmt.int(w.recomputed)), num(fmt.int(w.refused))];
  const rows = [];
  if (p.wasted_now) rows.push(row([`Batch ${fmt.int(p.wasted_now.batch)} (in flight)`, ...cells(p.wasted_now)]));
  for (const w of batches) rows.push(row([`Batch ${fmt.int(w.batch)}`, ...cells(w)]));
  const total = row(["All batches", ...cells({ redispatched: p.redispatched, recomputed: p.redone,
    refused: p.refused_results })]);
  total.className = "total";
  rows.push(total);
  fillTable($("pipeline-wasted"), rows);
}

/** "pipeline: 2 stages, 4 micro-batches of 2 per batch", from the Pipeline report. */
function pipelineMode(s) {
  const p = s.pipeline;
  if (!p) return "pipeline";
  const size = s.target_batch / Math.max(p.microbatches, 1);
  return `pipeline: ${fmt.int(p.stages.length)} stages, ${fmt.int(p.microbatches)} micro-batches of ` +
    `${fmt.int(size)} per batch`;
}

function renderConfig(s) {
  const c = s.config || {};
  const items = [
    ["Run", s.run_name],
    ["Model", c.model],
    ["Parameters", fmt.int(s.num_params)],
    ["Mode", s.local_sgd ? `local SGD: ${innerBudget(s.local_sgd)} per outer round`
      : c.mode === "pipeline" ? pipelineMode(s) : c.mode],
    [s.local_sgd ? "Outer optimizer" : "Optimizer", c.optimizer && `${c.optimizer}, lr ${c.lr}, ${c.schedule} schedule`],
    ["Target batch", fmt.int(s.target_batch)],
    ["Total steps", s.total_steps ? fmt.int(s.total_steps) : "until stopped"],
    ["Max staleness", c.max_staleness],
    ["Precision", c.precision || "each peer picks"],
    ["Compression", c.compression],
    ["Auth", s.auth_mode],
    ["Relay uptime", fmt.secs(s.uptime_s)],
  ];
  $("config").replaceChildren(...items.filter(([, v]) => v !== undefined && v !== null).flatMap(
    ([k, v]) => [el("dt", k), el("dd", v)]));
}

poll();
