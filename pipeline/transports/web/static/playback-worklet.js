// The agent's voice: a queue of PCM chunks and marks, played in order. A mark is reported
// ("played") once every sample queued before it has been output, which is how the call
// learns what the person heard; "clear" (barge-in) drops everything queued at once.
class Player extends AudioWorkletProcessor {
  constructor() {
    super();
    this.queue = [];  // {pcm: Float32Array, at: index} or {mark: name}
    this.played = 0;
    this.audible = 0;
    this.lastReport = 0;
    this.idle = true;
    this.port.onmessage = (e) => {
      const m = e.data;
      if (m.type === "audio") this.queue.push({pcm: m.pcm, at: 0});
      else if (m.type === "mark") this.queue.push({mark: m.name});
      else if (m.type === "clear") {
        let dropped = 0;
        for (const item of this.queue) if (item.pcm) dropped += item.pcm.length - item.at;
        this.queue = [];
        this.port.postMessage({type: "cleared", dropped});
      }
    };
  }
  process(inputs, outputs) {
    const out = outputs[0][0];
    let i = 0;
    while (this.queue.length) {
      const head = this.queue[0];
      if (head.mark !== undefined) {
        this.port.postMessage({type: "played", mark: head.mark});
        this.queue.shift();
        continue;
      }
      if (i >= out.length) break;
      if (this.idle) {
        // Agent audio starts after silence: when, on the audio clock (the page's voice to voice).
        this.idle = false;
        this.port.postMessage({type: "started", t: currentTime + i / sampleRate});
      }
      const n = Math.min(out.length - i, head.pcm.length - head.at);
      for (let k = 0; k < n; k++) {
        const s = head.pcm[head.at + k];
        out[i + k] = s;
        if (s > 0.01 || s < -0.01) this.audible++;
      }
      i += n;
      head.at += n;
      this.played += n;
      if (head.at >= head.pcm.length) this.queue.shift();
    }
    if (i < out.length) this.idle = true;  // ran dry: the next audio is a new start
    for (; i < out.length; i++) out[i] = 0;
    if (currentTime - this.lastReport >= 0.1) {
      this.lastReport = currentTime;
      this.port.postMessage({type: "progress", played: this.played, audible: this.audible});
    }
    return true;
  }
}
registerProcessor("player", Player);
