// The halo browser worker: runs the layer range the coordinator assigns with onnxruntime-web,
// on WebGPU where the browser offers it, else on WebAssembly, and answers over one WebSocket.
// Messages are halo's control-plane messages (halo/transport/reliable.py) packed into one binary
// WebSocket message each (halo/pipeline/protocol.py: ws_pack); the KV cache stays in this tab.
import * as ort from './ort.min.mjs';

const params = new URLSearchParams(location.search);
const $ = (id) => document.getElementById(id);
const show = (id, text) => { $(id).textContent = text; };
const setState = (state) => { document.body.dataset.state = state; show('state', state); };
const log = (line) => { $('log').textContent = `${new Date().toLocaleTimeString()} ${line}\n` + $('log').textContent; };

ort.env.wasm.wasmPaths = '/assets/';
ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
ort.env.logLevel = 'error';

// ---- the message codec -------------------------------------------------------------------------------
const DTYPES = { float32: Float32Array, int64: BigInt64Array, int32: Int32Array, uint8: Uint8Array, int8: Int8Array };
const encoder = new TextEncoder();
const decoder = new TextDecoder();

function unpack(buffer) {
  const view = new DataView(buffer);
  const count = view.getUint32(0, true);
  const frames = [];
  let offset = 4;
  for (let i = 0; i < count; i++) {
    const length = view.getUint32(offset, true);
    frames.push(buffer.slice(offset + 4, offset + 4 + length));
    offset += 4 + length;
  }
  const preamble = new Uint8Array(frames[0]);
  if (decoder.decode(preamble.subarray(0, 4)) !== 'HALO' || preamble[4] !== 2) throw new Error('not a halo message (or another halo version)');
  const header = JSON.parse(decoder.decode(frames[1]));
  const arrays = header.arrays.map(([dtype, shape], i) => {
    const Type = DTYPES[dtype];
    if (!Type) throw new Error(`unsupported dtype ${dtype}`);
    return { dtype, shape, data: new Type(frames[2 + i]) };
  });
  return { kind: header.kind, fields: header.fields, arrays };
}

function pack(kind, fields = {}, arrays = []) {
  const header = encoder.encode(JSON.stringify({ kind, fields, arrays: arrays.map((a) => [a.dtype, a.shape]) }));
  const frames = [new Uint8Array([72, 65, 76, 79, 2]), header,
    ...arrays.map((a) => new Uint8Array(a.data.buffer, a.data.byteOffset, a.data.byteLength))];
  const total = 4 + frames.reduce((n, f) => n + 4 + f.byteLength, 0);
  const out = new Uint8Array(total);
  const view = new DataView(out.buffer);
  view.setUint32(0, frames.length, true);
  let offset = 4;
  for (const f of frames) {
    view.setUint32(offset, f.byteLength, true);
    out.set(f, offset + 4);
    offset += 4 + f.byteLength;
  }
  return out.buffer;
}

// ---- the engine --------------------------------------------------------------------------------------
let engine = 'wasm';
async function pickEngine() {
  if (params.get('ep') === 'wasm' || !('gpu' in navigator)) return 'wasm';
  try {
    const adapter = await navigator.gpu.requestAdapter();
    return adapter ? 'webgpu' : 'wasm';
  } catch (e) {
    return 'wasm';
  }
}

function engineLabel() {
  return engine === 'webgpu' ? 'WebGPU (onnxruntime-web webgpu execution provider)'
    : `WebAssembly (onnxruntime-web wasm, ${ort.env.wasm.numThreads} thread${ort.env.wasm.numThreads > 1 ? 's' : ''})`;
}

async function download(part) {
  const url = `/models/${part}`;
  let response;
  if (self.caches) {  // content-addressed: a cached copy is always the right one
    const cache = await caches.open('halo-model-parts');
    response = await cache.match(url);
    if (!response) {
      response = await fetch(url);
      if (!response.ok) throw new Error(`GET ${url}: ${response.status}`);
      await cache.put(url, response.clone());
    }
  } else {
    response = await fetch(url, { cache: 'force-cache' });
    if (!response.ok) throw new Error(`GET ${url}: ${response.status}`);
  }
  return new Uint8Array(await response.arrayBuffer());
}

async function createSession(bytes) {
  try {
    return await ort.InferenceSession.create(bytes, { executionProviders: [engine], graphOptimizationLevel: 'all' });
  } catch (e) {
    if (engine !== 'webgpu') throw e;
    log(`WebGPU could not run this model (${e.message}); falling back to WebAssembly`);
    engine = 'wasm';
    show('engine', engineLabel());
    return ort.InferenceSession.create(bytes, { executionProviders: ['wasm'], graphOptimizationLevel: 'all' });
  }
}

// A stage: an ONNX session over a unit range plus its KV cache (present outputs become the next past).
class Stage {
  constructor(session, spec) {
    this.session = session;
    this.spec = spec;
    this.reset();
  }

  reset() {
    const { n_kv_heads: kvh, head_dim: hd } = this.spec;
    this.past = {};
    for (const l of this.spec.layers) {
      for (const kind of ['k', 'v']) this.past[`past_${kind}_${l}`] = new ort.Tensor('float32', new Float32Array(0), [kvh, 0, hd]);
    }
    this.positions = 0;
  }

  truncate(length) {  // keep positions 0..length-1 of every cache (a coordinator may rewind)
    const { n_kv_heads: kvh, head_dim: hd } = this.spec;
    for (const [name, tensor] of Object.entries(this.past)) {
      const have = tensor.dims[1];
      const out = new Float32Array(kvh * length * hd);
      for (let h = 0; h < kvh; h++) out.set(tensor.data.subarray(h * have * hd, h * have * hd + length * hd), h * length * hd);
      this.past[name] = new ort.Tensor('float32', out, [kvh, length, hd]);
    }
    this.positions = length;
  }

  async forward(input, startPos, head) {
    if (startPos > this.positions) throw new Error(`position ${startPos} would leave a hole in the KV cache, which holds ${this.positions} positions`);
    if (startPos < this.positions) this.truncate(startPos);
    const T = input.shape[0];
    const feeds = { ...this.past, start_pos: new ort.Tensor('int64', BigInt64Array.of(BigInt(startPos)), [1]) };
    if (this.spec.takes_tokens) feeds.tokens = new ort.Tensor('int64', input.data, [T]);
    else feeds.hidden = new ort.Tensor('float32', input.data, [T, this.spec.dim]);
    let rows = [T - 1];
    if (this.spec.head) {
      if (head.all_positions) rows = Array.from({ length: T }, (_, i) => i);
      feeds.head_rows = new ort.Tensor('int64', BigInt64Array.from(rows, BigInt), [rows.length]);
      feeds.k = new ort.Tensor('int64', BigInt64Array.of(BigInt(Math.max(1, Math.min(head.top_k, this.spec.vocab_size)))), [1]);
    }
    const out = await this.session.run(feeds);
    for (const l of this.spec.layers) {
      for (const kind of ['k', 'v']) this.past[`past_${kind}_${l}`] = out[`present_${kind}_${l}`];
    }
    this.positions = startPos + T;
    if (!this.spec.head) return [{ dtype: 'float32', shape: [T, this.spec.dim], data: out.hidden_out.data }];
    if (head.all_positions || head.top_k === 0) {
      return [{ dtype: 'float32', shape: [rows.length, this.spec.vocab_size], data: out.logits.data }];
    }
    const k = out.top_ids.data.length;
    return [{ dtype: 'int64', shape: [k], data: out.top_ids.data }, { dtype: 'float32', shape: [k], data: out.top_values.data }];
  }
}

async function timeDecode(part, spec, steps = 6, warmup = 2) {
  const stage = new Stage(await createSession(await download(part)), { ...spec, layers: spec.layersOf(part), takes_tokens: false, head: false });
  const x = { shape: [1, spec.dim], data: Float32Array.from({ length: spec.dim }, (_, i) => Math.sin(i)) };
  const times = [];
  for (let pos = 0; pos < warmup + steps; pos++) {
    const t = performance.now();
    await stage.forward(x, pos, { top_k: 1, all_positions: false });
    times.push(performance.now() - t);
  }
  await stage.session.release();
  const timed = times.slice(warmup).sort((a, b) => a - b);
  return timed[Math.floor(timed.length / 2)] / 1e3;
}

function memoryBudget() {
  if (params.get('memory_mb')) return Number(params.get('memory_mb')) * 1e6;
  return (navigator.deviceMemory || 4) * 0.25e9;  // browsers do not say more; ?memory_mb=N overrides
}

// ---- the conversation with the coordinator -------------------------------------------------------------
let stage = null;
let session = '';
let forwards = 0;
let sent = 0;
let received = 0;

async function handle(message) {
  const f = message.fields;
  switch (message.kind) {
    case 'ping':
      return pack('pong', {}, message.arrays);
    case 'probe': {
      setState('probing');
      const spec = { dim: f.dim, n_kv_heads: f.n_kv_heads, head_dim: f.head_dim, layersOf: (p) => (p === f.parts[0] ? [0] : [0, 1]) };
      const one = await timeDecode(f.parts[0], spec);
      let perLayer = one;
      let overhead = 0;
      if (f.parts.length > 1) {
        const two = await timeDecode(f.parts[1], spec);
        perLayer = Math.max(two - one, 0.2 * two);
        overhead = Math.max(0, one - perLayer);
      }
      show('bench', `${(perLayer * 1e3).toFixed(2)} ms per layer, ${(overhead * 1e3).toFixed(2)} ms per call`);
      setState('joined');
      return pack('probe', { engine: `onnx-${engine}`, layer_s: perLayer, overhead_s: overhead, memory_bytes: memoryBudget(), name: 'browser' });
    }
    case 'hello': {
      if (f.protocol !== 1) return pack('refused', { reason: `stage protocol ${f.protocol} but this page speaks 1: reload it` });
      setState('loading');
      const t = performance.now();
      const bytes = await download(f.part);
      if (stage) await stage.session.release();
      stage = new Stage(await createSession(bytes), f);
      session = f.session;
      const layers = f.layers.length ? `layers ${f.layers[0]}..${f.layers[f.layers.length - 1]}` : 'no layers';
      show('assigned', `units [${f.start}, ${f.stop}): ${f.takes_tokens ? 'embedding, ' : ''}${layers}${f.head ? ', head' : ''} · ${(bytes.length / 1e6).toFixed(1)} MB (${f.part.slice(0, 12)}…)`);
      setState('ready');
      return pack('ready', { name: 'browser', engine: `onnx-${engine}`, weight_bytes: bytes.length, load_ms: performance.now() - t });
    }
    case 'forward': {
      if (!stage || f.session !== session) return pack('error', { reason: 'not in session with this tab' });
      const t = performance.now();
      const outputs = await stage.forward(message.arrays[0], f.start_pos, f.head);
      const ms = performance.now() - t;
      forwards += 1;
      show('forwards', String(forwards));
      show('last', `${ms.toFixed(1)} ms at position ${f.start_pos} (${message.arrays[0].shape[0]} token${message.arrays[0].shape[0] > 1 ? 's' : ''})`);
      setState('serving');
      return pack('output', { compute_ms: ms, positions: stage.positions }, outputs);
    }
    case 'reset':
      if (stage) stage.reset();
      return pack('ok');
    case 'bye':
      session = '';
      setState('idle');
      return null;
    default:
      return pack('error', { reason: `unknown message kind ${message.kind}` });
  }
}

async function main() {
  engine = await pickEngine();
  show('engine', engineLabel());
  const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
  const url = `${scheme}://${location.host}/ws?token=${encodeURIComponent(params.get('token') || '')}`;
  show('coordinator', location.host);
  setState('connecting');
  const ws = new WebSocket(url);
  ws.binaryType = 'arraybuffer';
  let queue = Promise.resolve();
  ws.onopen = () => { setState('connected'); log('connected; waiting for the coordinator'); };
  ws.onclose = (event) => { setState('closed'); log(`disconnected (${event.code}${event.reason ? ': ' + event.reason : ''})`); };
  ws.onmessage = (event) => {
    queue = queue.then(async () => {
      received += event.data.byteLength;
      let reply;
      try {
        reply = await handle(unpack(event.data));
      } catch (e) {
        log(`error: ${e.message}`);
        reply = pack('error', { reason: `browser worker: ${e.message}` });
      }
      if (reply) {
        sent += reply.byteLength;
        ws.send(reply);
      }
      show('traffic', `${(received / 1e3).toFixed(1)} kB in, ${(sent / 1e3).toFixed(1)} kB out`);
    });
  };
}

main().catch((e) => { setState('error'); log(e.stack || String(e)); });
