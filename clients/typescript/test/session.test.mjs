// Drives a short session through the TypeScript client against a real server.
//
//   CONTEXT_ENGINE_TARGET=127.0.0.1:50051 node --test test/
//
// tests/e2e/test_node_client.py starts the server on a free port and runs this file; it
// fails (never skips) when the address is missing.

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, test } from 'node:test';

import {
  AbortedError,
  ContextEngineClient,
  InvalidArgumentError,
  NotFoundError,
  assistantMessage,
  tool,
  toolCall,
  toolResult,
} from '../dist/src/index.js';

const target = process.env.CONTEXT_ENGINE_TARGET;
const NOW = new Date('2026-03-14T23:40:00Z');
const LATER = new Date('2026-03-15T00:20:00Z'); // past midnight in Paris and UTC

const spec = {
  model_id: 'claude-sonnet-4-5',
  agent: { agent_id: 'trips', version: '1', instructions: 'Plan train trips.' },
  principal: { principal_id: 'ada', scopes: ['web.read'], scope_label: 'owner' },
  tools: [
    tool(
      'web.fetch',
      'Fetch a page.',
      { type: 'object', properties: { url: { type: 'string' } }, required: ['url'] },
      { requiredScopes: ['web.read'], sideEffect: 'SIDE_EFFECT_NETWORK_READ' },
    ),
  ],
  environment: { surface: 'chat', time_zone: 'Europe/Paris' },
};

let engine;

before(() => {
  assert.ok(target, 'CONTEXT_ENGINE_TARGET must name a running server (host:port)');
  engine = new ContextEngineClient({ target, tenantId: `tenant-node-${randomUUID()}` });
});

after(() => engine?.close());

const blockKinds = (build) =>
  build.request.messages.flatMap((message) => message.blocks.map((block) => block.kind));

test('plan, run, tool pair, two builds: one prefix, same bytes', async () => {
  const session = await engine.openSession(spec);
  assert.equal(session.created, true);
  assert.equal(session.plan.epoch, 1);
  assert.match(session.plan.prefix_sha256, /^[0-9a-f]{64}$/);

  const run = await session.startRun('Trains from Paris to Lyon tomorrow?');
  assert.equal(run.checkpointVersion, 1);
  const first = await run.build({ now: NOW });
  assert.equal(first.prefixSha256, session.plan.prefix_sha256);
  assert.ok(!blockKinds(first).includes('tool_call'));

  const appended = await run.append([
    toolCall('call-1', 'web.fetch', { url: 'https://trains.example' }),
    toolResult('call-1', 'web.fetch', '08:04 TGV 6601 Paris-Lyon'),
  ]);
  assert.equal(appended.sequences.length, 2);
  assert.equal(run.checkpointVersion, 2);

  const built = await run.build({ now: LATER });
  const again = await run.build({ now: LATER });
  assert.equal(built.prefixSha256, again.prefixSha256);
  assert.equal(built.prefixSha256, first.prefixSha256, 'the prefix survives midnight');
  assert.equal(built.requestSha256, again.requestSha256, 'Build is pure');
  assert.equal(built.checkpointVersion, 2);
  assert.ok(again.requestSequence > built.requestSequence);
  const kinds = blockKinds(built);
  assert.ok(kinds.indexOf('tool_call') < kinds.indexOf('tool_result'));
});

test('the tool loop appends each step and ends on a plain answer', async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('And back on Sunday?');
  const seen = [];
  const result = await run.toolLoop({
    now: NOW,
    callModel: async (build) => {
      seen.push(build);
      // What a provider would report: the prefix read from cache after the first call.
      const prefix = build.response.prefix_tokens;
      const cached = seen.length > 1 ? prefix : 0;
      const usage = {
        inputTokens: build.response.estimated_input_tokens - cached,
        cacheReadInputTokens: cached,
        cacheCreationInputTokens: prefix - cached,
        outputTokens: 30,
      };
      // Providers answer with the wire name: "web.fetch" is sent as "web-fetch".
      const call = { callId: 'c1', name: 'web-fetch', arguments: { url: 'https://x' } };
      return seen.length === 1
        ? { text: 'Checking.', toolCalls: [call], usage }
        : { text: 'The 18:04 gets you home.', usage };
    },
    runTool: async (call) => {
      assert.equal(call.name, 'web.fetch');
      return '18:04 TGV 6642';
    },
  });
  assert.equal(result.final.text, 'The 18:04 gets you home.');
  assert.equal(result.builds.length, 2);
  assert.deepEqual(new Set(result.builds.map((b) => b.prefixSha256)), new Set([session.plan.prefix_sha256]));
  assert.equal(run.checkpointVersion, 3);
  const logged = result.builds[1].request.messages
    .flatMap((message) => message.blocks)
    .filter((block) => block.kind === 'tool_call')
    .map((block) => block.tool_call.tool_name);
  assert.deepEqual(logged, ['web.fetch'], 'the loop maps wire names back');
  assert.deepEqual(
    result.reports.map((r) => r.cached_prefix_ppm),
    [0, 1_000_000],
  );
  assert.ok(typeof result.builds[0].payload() === 'object', 'provider payload is JSON');
});

test('errors are typed with reason and field', async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('Hello');

  await assert.rejects(run.append([toolResult('never-called', 'web.fetch', 'x')]), (error) => {
    assert.ok(error instanceof InvalidArgumentError);
    assert.equal(error.reason, 'ORPHANED_TOOL_ITEM');
    assert.equal(error.field, 'items[0].tool_result.call_id');
    return true;
  });
  assert.equal(run.checkpointVersion, 1);

  const stale = session.run(run.runId, 1);
  await run.append([assistantMessage('Hi.')]);
  await assert.rejects(stale.append([assistantMessage('Hi again.')]), (error) => {
    assert.ok(error instanceof AbortedError);
    assert.equal(error.reason, 'CHECKPOINT_VERSION_CONFLICT');
    return true;
  });

  await assert.rejects(engine.session(randomUUID()), (error) => {
    assert.ok(error instanceof NotFoundError);
    assert.equal(error.reason, 'SESSION_NOT_FOUND');
    assert.equal(error.codeName, 'NOT_FOUND');
    return true;
  });
});

test('a tool named outside the BMP maps back from its wire name', async () => {
  // The server replaces per code point: "search.\u{1F50D}" is sent as "search--".
  const name = 'search.\u{1F50D}';
  const session = await engine.openSession({
    ...spec,
    tools: [tool(name, 'Search.', { type: 'object' })],
  });
  const run = await session.startRun('Find it.');
  const ran = [];
  let sent;
  await run.toolLoop({
    now: NOW,
    callModel: async (build) => {
      if (sent === undefined) {
        sent = build.payload().tools.map((t) => t.name);
        return { toolCalls: [{ callId: 'toolu_01', name: sent[0], arguments: {} }] };
      }
      return { text: 'Found.' };
    },
    runTool: async (call) => {
      ran.push(call.name);
      return 'result';
    },
  });
  assert.deepEqual(sent, ['search--']);
  assert.deepEqual(ran, [name], 'the loop maps the wire name back to the real one');
});

test('a Build over 4 MiB is received on the default channel', async () => {
  // gpt-4.1's window takes about 2.4 MB of text without compaction; the response carries
  // it twice (neutral request and provider payload).
  const words = ['international', 'administration', 'understanding', 'responsibility'];
  const session = await engine.openSession({ ...spec, model_id: 'gpt-4.1' });
  const run = await session.startRun('Summarise the notes below.');
  for (let n = 0; n < 3; n++) {
    const text = Array.from({ length: 60_000 }, (_, k) => words[(k * 7 + n) % words.length]);
    await run.append([assistantMessage(text.join(' '))]);
  }
  const built = await run.build({ now: NOW });
  assert.equal(built.response.needs_compaction, false);
  assert.ok(built.providerPayload.length > 2 * 1024 * 1024, `${built.providerPayload.length}`);
});
