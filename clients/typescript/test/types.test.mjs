// The package's types as a consumer sees them: a project under `module`/`moduleResolution`
// NodeNext (Node's own ESM rules, where a relative import needs its `.js`) with
// skipLibCheck, the common setting, importing the built package by name.
//
// Types that do not resolve there do not fail loudly: with skipLibCheck they silently
// become `any`, and every misspelled field compiles. So the consumer marks each misuse
// with `@ts-expect-error`, which is itself an error when the line compiles, and also
// compiles the README's example, which must type-check under `strict` as written.
//
// Needs the package built (`npm run build`); no server.

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

const PACKAGE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');

const MISUSE = `import { ContextEngineClient, type ConversationItem, type PlanSpec, usageFromAnthropic } from '@context-engine/client';

const engine = new ContextEngineClient({ target: '127.0.0.1:50051', tenantId: 'acme' });
// @ts-expect-error: the field is model_id (the proto's snake_case names).
const misspelled: PlanSpec = { modelId: 'claude-sonnet-4-5' };
// @ts-expect-error: the item kind is tool_call.
const item: ConversationItem = { toolcall: { call_id: 'c' } };
const session = await engine.openSession({ model_id: 'claude-sonnet-4-5' });
// @ts-expect-error: epoch is a number.
const epoch: string = session.plan.epoch;
// @ts-expect-error: rotate takes a PlanReason name.
await session.rotate('AGENT_CHANGED');
await session.rotate('PLAN_REASON_AGENT_CHANGED', { idempotencyKey: 'rotate-1' });
// The Anthropic SDK's Usage as it is: an interface (no index signature), counts nullable.
interface SdkUsage {
  input_tokens: number;
  output_tokens: number;
  cache_read_input_tokens: number | null;
  cache_creation_input_tokens: number | null;
  server_tool_use: { web_search_requests: number } | null;
}
declare const sdkUsage: SdkUsage;
const reported = usageFromAnthropic(sdkUsage);
export { item, epoch, misspelled, reported };
`;

/** The first ```ts block of the package's README. */
function readmeExample() {
  const readme = fs.readFileSync(path.join(PACKAGE, 'README.md'), 'utf8');
  const block = /```ts\n([\s\S]*?)```/.exec(readme);
  assert.ok(block, 'README.md has a ```ts example');
  return block[1];
}

/** tsc over `files` in a fresh consumer project that depends on this package. */
function typecheck(files) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'context-engine-consumer-'));
  try {
    fs.writeFileSync(
      path.join(dir, 'package.json'),
      JSON.stringify({ name: 'consumer', private: true, type: 'module' }),
    );
    fs.mkdirSync(path.join(dir, 'node_modules', '@context-engine'), { recursive: true });
    fs.symlinkSync(PACKAGE, path.join(dir, 'node_modules', '@context-engine', 'client'), 'dir');
    const compilerOptions = {
      target: 'ES2022',
      module: 'NodeNext',
      moduleResolution: 'NodeNext',
      strict: true,
      noEmit: true,
      skipLibCheck: true,
      types: ['node'],
      typeRoots: [path.join(PACKAGE, 'node_modules', '@types')],
    };
    fs.writeFileSync(
      path.join(dir, 'tsconfig.json'),
      JSON.stringify({ compilerOptions, files: Object.keys(files) }),
    );
    for (const [name, text] of Object.entries(files)) fs.writeFileSync(path.join(dir, name), text);
    const tsc = path.join(PACKAGE, 'node_modules', 'typescript', 'bin', 'tsc');
    const result = spawnSync(process.execPath, [tsc, '-p', dir], { encoding: 'utf8' });
    return { status: result.status, output: `${result.stdout}${result.stderr}` };
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

test('a NodeNext consumer gets real types: misspelled fields do not compile', () => {
  const { status, output } = typecheck({ 'misuse.ts': MISUSE });
  assert.equal(status, 0, output);
});

test("the README's example type-checks under strict NodeNext", () => {
  const { status, output } = typecheck({ 'readme.ts': readmeExample() });
  assert.equal(status, 0, output);
});
