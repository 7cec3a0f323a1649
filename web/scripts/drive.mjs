// Opens the worker page in headless Chromium (Debian's `chromium`) and keeps the tab open, for tests and
// the README screenshot. WebGPU comes from SwiftShader (no GPU needed; slow).
//   node scripts/drive.mjs URL [--wasm] [--screenshot FILE --after N] [--timeout S]
// Prints "STATE <state> <engine>" lines; exits when stdin closes or on SIGTERM.
import { chromium } from 'playwright-core';

const argv = process.argv.slice(2);
const opt = (name, fallback) => { const i = argv.indexOf(name); return i >= 0 ? argv[i + 1] : fallback; };
let url = argv[0];
if (argv.includes('--wasm')) url += '&ep=wasm';
const screenshot = opt('--screenshot');
const after = Number(opt('--after', '1'));
const timeout = 1000 * Number(opt('--timeout', '300'));

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  headless: true,
  args: ['--no-sandbox', '--enable-unsafe-webgpu', '--enable-features=Vulkan', '--use-vulkan=swiftshader',
    '--use-webgpu-adapter=swiftshader', '--disable-vulkan-surface', '--ignore-gpu-blocklist'],
});
const stop = async () => { await browser.close().catch(() => {}); process.exit(0); };
process.on('SIGTERM', stop);
process.stdin.on('end', stop);
process.stdin.resume();
const page = await browser.newPage({ viewport: { width: 860, height: 620 } });
page.on('console', (m) => { if (m.type() === 'error') console.log(`console: ${m.text()}`); });
page.on('pageerror', (e) => console.log(`pageerror: ${e.message}`));
await page.goto(url);
const report = async () => console.log(`STATE ${await page.evaluate(() => `${document.body.dataset.state} ${document.getElementById('engine').textContent}`)}`);
await page.waitForFunction(() => document.getElementById('engine').textContent !== '–', null, { timeout });
await report();
if (screenshot) {
  await page.waitForFunction((n) => Number(document.getElementById('forwards').textContent) >= n, after, { timeout });
  await page.screenshot({ path: screenshot });
  console.log(`SCREENSHOT ${screenshot}`);
}
await report();
