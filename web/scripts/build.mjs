// Copies the worker page and onnxruntime-web (the files its WebGPU/WASM build loads) into
// halo/pipeline/web_assets, which the Python package serves and ships as package data.
// Nothing is bundled or fetched: the files come from node_modules, installed by `npm ci`.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const out = join(here, '..', '..', 'halo', 'pipeline', 'web_assets');
const ort = join(here, '..', 'node_modules', 'onnxruntime-web', 'dist');
const files = [
  [join(here, '..', 'src', 'index.html'), 'index.html'],
  [join(here, '..', 'src', 'worker.js'), 'worker.js'],
  // ort.min.mjs runs WASM and WebGPU through its JSEP build, and loads nothing else
  [join(ort, 'ort.min.mjs'), 'ort.min.mjs'],
  [join(ort, 'ort-wasm-simd-threaded.jsep.mjs'), 'ort-wasm-simd-threaded.jsep.mjs'],
  [join(ort, 'ort-wasm-simd-threaded.jsep.wasm'), 'ort-wasm-simd-threaded.jsep.wasm'],
];
rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
for (const [from, name] of files) copyFileSync(from, join(out, name));
console.log(`built ${readdirSync(out).length} files into ${out}`);
