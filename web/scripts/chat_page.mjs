// Drive the chat page and cluster view of a running `halo-master serve` in headless Chromium.
//
//   npm ci --prefix web            (playwright-core, a dev dependency of the worker page: it downloads no browser)
//   node web/scripts/chat_page.mjs URL OUT.png [API_KEY] [MESSAGE]      (MAX_TOKENS=N: the answer's budget)
//
// Opens URL, sends MESSAGE, waits for the streamed answer to finish and for the cluster view to show
// per-device numbers, checks both, saves a screenshot and prints one JSON line with what it saw.
// Chromium: Debian's package (/usr/bin/chromium) or CHROMIUM=/path/to/chrome.
import { chromium } from "playwright-core";

const [url, out, apiKey = "", message = "Once upon a time, in a small village,"] = process.argv.slice(2);
if (!url || !out) {
  console.error("usage: node chat_page.mjs URL OUT.png [API_KEY] [MESSAGE]");
  process.exit(2);
}
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1360, height: 820 }, deviceScaleFactor: 1 });
  const problems = [];
  page.on("pageerror", (e) => problems.push("page error: " + e.message));
  page.on("console", (m) => { if (m.type() === "error") problems.push("console: " + m.text()); });
  if (apiKey) await page.addInitScript((key) => localStorage.setItem("halo-api-key", key), apiKey);
  await page.goto(url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => !document.getElementById("model-name").textContent.includes("…"));
  if (process.env.MAX_TOKENS) await page.fill("#max-tokens", process.env.MAX_TOKENS);
  await page.fill("#prompt", message);
  await page.click("#send");
  const answer = page.locator(".msg.assistant").last();
  await answer.waitFor();
  // streamed: the bubble grows while it carries the cursor class, then gets its meta line
  await page.waitForFunction(() => {
    const m = [...document.querySelectorAll(".msg.assistant")].pop();
    return m && m.classList.contains("streaming") && m.textContent.length > 0;
  }, null, { timeout: 60000 });
  await page.waitForSelector(".msg.assistant:not(.streaming) .meta", { timeout: 120000 });
  // live cluster numbers: every device row has a compute time per token
  await page.waitForFunction(() => {
    const rows = [...document.querySelectorAll("#devices tbody tr")];
    return rows.length > 0 && rows.every((r) => r.children[3].textContent !== "–");
  }, null, { timeout: 30000 });
  await page.waitForTimeout(800); // one more live update, so the screenshot shows settled numbers
  const seen = await page.evaluate(() => ({
    answer: [...document.querySelectorAll(".msg.assistant")].pop().firstChild.textContent,
    meta: document.querySelector(".msg.assistant .meta").textContent,
    state: document.getElementById("state").textContent,
    tokensPerS: document.getElementById("tokens-per-s").textContent,
    devices: [...document.querySelectorAll("#devices tbody tr")].map((r) => [...r.children].map((c) => c.textContent)),
    lossSummary: document.getElementById("loss-summary").textContent,
    lossLayers: document.querySelectorAll("#loss-layers .row").length,
  }));
  await page.screenshot({ path: out });
  seen.problems = problems;
  console.log(JSON.stringify(seen));
  if (problems.length) process.exitCode = 1;
} finally {
  await browser.close();
}
