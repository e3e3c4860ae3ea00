// The call page: microphone -> AudioWorklet -> int16 PCM over a WebSocket to the server;
// the agent's PCM back into a playback AudioWorklet; the call's events drawn as they come.
// Everything from the server is shown with textContent (a caller may say anything).
// window.specvoice holds the page's state, for people debugging and for the tests.
"use strict";

const RATE = 16000;
const VOICED_RMS = 0.01;  // a microphone frame this loud is the person speaking
// Report figures, in the order a turn's silence passes through them.
const METRICS = [
  ["eot_delay", "end of turn"],
  ["stt_latency", "STT"],
  ["ttft", "first token"],
  ["first_sentence_latency", "first sentence"],
  ["tts_first_audio", "TTS first audio"],
  ["voice_to_voice", "voice to voice"],
];

const S = window.specvoice = {
  state: "idle", callId: null, report: null, error: null,
  events: [], clears: 0, clearLog: [], marksPlayed: 0, lastVoiced: null, pageV2V: [],
  audio: {received: 0, played: 0, audible: 0, dropped: 0},
  turns: {},  // index -> {metrics, provisional, final}
};

let ctx = null, ws = null, mic = null, player = null, capture = null;
const $ = (id) => document.getElementById(id);

function setState(state, text) {
  S.state = state;
  $("status").dataset.state = state;
  $("status").textContent = text || state;
  $("call").disabled = !(state === "idle" || state === "ended" || state === "failed");
  $("hangup").disabled = !(state === "connecting" || state === "in-call");
}

async function startCall() {
  $("report").hidden = true;
  $("transcript").textContent = "";
  $("turns").textContent = "";
  S.turns = {};
  S.events = [];
  setState("connecting", "connecting…");
  try {
    // One context at the server's rate for both directions: the browser resamples the microphone.
    ctx = new AudioContext({sampleRate: RATE, latencyHint: "interactive"});
    await ctx.audioWorklet.addModule("/static/capture-worklet.js");
    await ctx.audioWorklet.addModule("/static/playback-worklet.js");
    mic = await navigator.mediaDevices.getUserMedia({audio: {
      channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true}});
    player = new AudioWorkletNode(ctx, "player", {numberOfInputs: 0, numberOfOutputs: 1, outputChannelCount: [1]});
    player.connect(ctx.destination);
    player.port.onmessage = onPlayer;
    capture = new AudioWorkletNode(ctx, "capture", {numberOfInputs: 1, numberOfOutputs: 0});
    ctx.createMediaStreamSource(mic).connect(capture);
    await ctx.resume();
  } catch (err) {
    fail("cannot use the microphone or audio: " + err);
    return;
  }
  ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/call");
  ws.binaryType = "arraybuffer";
  ws.onmessage = onServer;
  ws.onclose = onClose;
  ws.onerror = () => { if (S.state === "connecting") fail("the server refused the call (busy, or not allowed)"); };
  capture.port.onmessage = (e) => {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(e.data.pcm);
    meter(new Int16Array(e.data.pcm));
    if (e.data.rms > VOICED_RMS) S.lastVoiced = e.data.t;
  };
}

function meter(pcm) {
  let peak = 0;
  for (let i = 0; i < pcm.length; i++) peak = Math.max(peak, Math.abs(pcm[i]));
  $("level").style.width = Math.min(100, Math.round(100 * peak / 16384)) + "%";
}

function hangUp() {
  if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: "hangup"}));
  stopAudio();
  setState("ending", "hanging up…");
}

function stopAudio() {
  if (mic) mic.getTracks().forEach((t) => t.stop());
  mic = null;
  if (capture) capture.port.onmessage = null;
}

function fail(text) {
  S.error = text;
  stopAudio();
  setState("failed", text);
}

function onClose() {
  stopAudio();
  if (ctx) setTimeout(() => { if (ctx) { ctx.close(); ctx = null; } }, 500);
  if (S.state !== "failed") setState("ended", S.report ? "call over" : "call over (no report)");
  ws = null;
}

function onPlayer(e) {
  const m = e.data;
  if (m.type === "played") {
    S.marksPlayed++;
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({type: "played", mark: m.mark}));
  } else if (m.type === "started") {
    // Voice to voice as this page hears it: the last voiced microphone frame to the agent's
    // first sample out of the player (audio clock; the sound card's own latency comes on top).
    if (S.lastVoiced !== null) S.pageV2V.push(Math.round((m.t - S.lastVoiced) * 1000) / 1000);
    S.lastVoiced = null;
  } else if (m.type === "progress") {
    S.audio.played = m.played;
    S.audio.audible = m.audible;
  } else if (m.type === "cleared") {
    S.audio.dropped += m.dropped;
  }
}

function onServer(e) {
  if (typeof e.data !== "string") {
    const pcm16 = new Int16Array(e.data);
    const pcm = new Float32Array(pcm16.length);
    for (let i = 0; i < pcm16.length; i++) pcm[i] = pcm16[i] / 32768;
    S.audio.received += pcm.length;
    player.port.postMessage({type: "audio", pcm}, [pcm.buffer]);
    return;
  }
  const m = JSON.parse(e.data);
  if (m.type === "ready") {
    S.callId = m.call_id;
    setState("in-call", "in call: speak");
  } else if (m.type === "mark") {
    player.port.postMessage({type: "mark", name: m.name});
  } else if (m.type === "clear") {
    // Barge-in: the agent's queued audio stops now (the server sends no more of it).
    S.clears++;
    S.clearLog.push({received: S.audio.received, played: S.audio.played});
    player.port.postMessage({type: "clear"});
  } else if (m.type === "event") {
    S.events.push(m);
    onEvent(m);
  } else if (m.type === "turn") {
    finalTurn(m.entry);
  } else if (m.type === "ended") {
    S.report = m.report;
    $("report-link").href = m.report;
    $("report").hidden = false;
  }
}

// ------------------------------------------------------------------ transcript

function line(cls, key) {
  let li = document.querySelector(`#transcript li[data-key="${key}"]`);
  if (!li) {
    li = document.createElement("li");
    li.className = cls;
    li.dataset.key = key;
    $("transcript").appendChild(li);
    li.scrollIntoView({block: "nearest"});
  }
  return li;
}

function agentSentence(turn, text, heard) {
  const li = line("agent", "agent-" + turn);
  li.dataset.turn = turn;
  let span = [...li.querySelectorAll(".s")].find((s) => s.textContent === text + " " && !(heard && s.classList.contains("heard")));
  if (!span) {
    // (A greeting is spoken without a sentence event: its first sign is "heard".)
    span = document.createElement("span");
    span.className = "s";
    span.textContent = text + " ";
    li.appendChild(span);
  }
  if (heard) span.classList.add("heard");
}

const pending = {};  // the caller's turn being spoken: its events' times, for provisional bars

function onEvent(m) {
  const turnKey = m.turn === undefined ? null : m.turn;
  switch (m.kind) {
    case "speech_started":
      pending.speech = m.t;
      break;
    case "transcript_interim":
    case "transcript_stable":
    case "transcript_pause": {
      const li = line("caller interim", "caller-live");
      li.textContent = m.text || "";
      break;
    }
    case "end_of_turn":
      pending.eot = {t: m.t, delay: m.delay};
      break;
    case "transcript": {
      const live = document.querySelector('#transcript li[data-key="caller-live"]');
      if (live) live.remove();
      const li = line("caller", "caller-" + turnKey);
      li.dataset.turn = turnKey;
      li.textContent = m.text;
      const turn = turnState(turnKey);
      if (pending.eot) {
        turn.t_end = pending.eot.t;
        provisional(turnKey, "eot_delay", pending.eot.delay);
        provisional(turnKey, "stt_latency", m.t - pending.eot.t);
      }
      turn.t_transcript = m.t;
      pending.eot = null;
      break;
    }
    case "llm_text": {
      const turn = turnState(turnKey);
      if (turn.t_transcript !== undefined && turn.ttft === undefined) {
        turn.ttft = m.t - turn.t_transcript;
        provisional(turnKey, "ttft", turn.ttft);
      }
      break;
    }
    case "sentence": {
      agentSentence(turnKey, m.text, false);
      const turn = turnState(turnKey);
      if (turn.t_transcript !== undefined && turn.first === undefined) {
        turn.first = m.t - turn.t_transcript;
        provisional(turnKey, "first_sentence_latency", turn.first);
      }
      break;
    }
    case "heard":
      agentSentence(turnKey, m.text, true);
      break;
    case "barge_in": {
      const li = document.querySelector(`#transcript li[data-key="agent-${turnKey}"]`);
      if (li) li.classList.add("interrupted");
      break;
    }
    case "turn_taken_back": {
      // The caller went on before the answer was heard (pipeline/stages/take_back.py): that
      // turn is not answered, and its words begin the next, which takes the same index. What
      // the agent had begun goes, and so do the turn's provisional bars; the caller's line
      // stays until the joined turn's transcript replaces it.
      const key = m.before_turn;
      const agent = document.querySelector(`#transcript li[data-key="agent-${key}"]`);
      if (agent) agent.remove();
      const box = document.querySelector(`#turns .turn[data-turn="${key}"]`);
      if (box) box.remove();
      delete S.turns[key];
      break;
    }
  }
}

// ------------------------------------------------------------------ latency bars

function turnState(index) {
  if (!S.turns[index]) S.turns[index] = {metrics: {}, final: false};
  return S.turns[index];
}

function turnBox(index) {
  let box = document.querySelector(`#turns .turn[data-turn="${index}"]`);
  if (!box) {
    box = document.createElement("div");
    box.className = "turn";
    box.dataset.turn = index;
    const h = document.createElement("h3");
    h.textContent = index < 0 ? "Greeting" : `Turn ${index}`;
    box.appendChild(h);
    for (const [key, label] of METRICS) {
      const row = document.createElement("div");
      row.className = "bar";
      row.dataset.metric = key;
      const name = document.createElement("span");
      name.textContent = label;
      const track = document.createElement("span");
      track.className = "track";
      const fill = document.createElement("span");
      fill.className = "fill";
      track.appendChild(fill);
      const v = document.createElement("span");
      v.className = "v";
      v.textContent = "…";
      row.append(name, track, v);
      box.appendChild(row);
    }
    $("turns").appendChild(box);
  }
  return box;
}

function drawBar(index, key, value, exact) {
  const row = turnBox(index).querySelector(`.bar[data-metric="${key}"]`);
  if (!row || typeof value !== "number" || !isFinite(value)) return;
  const scale = Math.max(3, ...Object.values(turnState(index).metrics).filter((x) => typeof x === "number"));
  row.querySelector(".fill").style.width = Math.max(1, Math.min(100, 100 * value / scale)) + "%";
  row.querySelector(".v").textContent = (exact ? "" : "~") + Math.round(value * 1000) + " ms";
  row.classList.toggle("provisional", !exact);
  row.dataset.value = value;
  row.dataset.exact = exact ? "1" : "0";
}

function provisional(index, key, value) {
  const turn = turnState(index);
  if (turn.final || typeof value !== "number") return;
  turn.metrics[key] = value;
  drawBar(index, key, value, false);
}

function finalTurn(entry) {
  const turn = turnState(entry.index);
  turn.final = true;
  turn.entry = entry;
  const m = entry.metrics || {};
  turn.metrics = {};
  for (const [key] of METRICS) {
    const value = key === "eot_delay" ? (m.eot_delay ?? m.endpoint_delay) : key === "stt_latency"
      ? (m.stt_after_endpoint ?? m.stt_latency) : m[key];
    if (typeof value === "number") turn.metrics[key] = value;
  }
  const box = turnBox(entry.index);
  box.dataset.final = "1";
  for (const [key, value] of Object.entries(turn.metrics)) drawBar(entry.index, key, value, true);
  const llm = entry.llm || {};
  if (typeof llm.tokens_per_pass === "number") {
    let p = box.querySelector("p.llm");
    if (!p) { p = document.createElement("p"); p.className = "llm muted"; box.appendChild(p); }
    p.textContent = `LLM: ${llm.new_tokens} tokens in ${llm.passes} passes, ${llm.tokens_per_pass.toFixed(2)} tokens/pass, ` +
      `${(llm.tokens_per_s || 0).toFixed(1)} tokens/s`;
  }
  if (entry.interrupted) box.classList.add("interrupted");
}

document.addEventListener("DOMContentLoaded", () => {
  $("call").addEventListener("click", startCall);
  $("hangup").addEventListener("click", hangUp);
  setState("idle", "ready");
});
