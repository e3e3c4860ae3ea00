// The microphone, 20 ms at a time, as int16 PCM for the server (the AudioContext runs at
// 16 kHz, the rate the server's speech models take, so no resampling happens here).
class Capture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = Math.round(sampleRate * 0.02);
    this.buf = new Int16Array(this.frame);
    this.n = 0;
    this.energy = 0;
  }
  process(inputs) {
    const input = inputs[0] && inputs[0][0];
    if (!input) return true;
    for (let i = 0; i < input.length; i++) {
      const s = Math.max(-1, Math.min(1, input[i]));
      this.buf[this.n++] = s < 0 ? s * 32768 : s * 32767;
      this.energy += s * s;
      if (this.n === this.frame) {
        // `t`: the audio clock at the frame's end, for the page's own voice-to-voice figure.
        const rms = Math.sqrt(this.energy / this.frame);
        this.port.postMessage({pcm: this.buf.buffer, t: currentTime + (i + 1) / sampleRate, rms}, [this.buf.buffer]);
        this.buf = new Int16Array(this.frame);
        this.n = 0;
        this.energy = 0;
      }
    }
    return true;
  }
}
registerProcessor("capture", Capture);
