// Drives a short session through the TypeScript client against a real server.
//
//   CONTEXT_ENGINE_TARGET=127.0.0.1:50051 node --test test/
//
// tests/e2e/test_node_client.py starts the server on a free port and runs this file; it
// fails (never skips) when the address is missing.

import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import net from 'node:net';
import { after, before, test } from 'node:test';

import {
  AbortedError,
  ContextEngineClient,
  DeadlineExceededError,
  FailedPreconditionError,
  InvalidArgumentError,
  NotFoundError,
  UnavailableError,
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

test('attachments are placed beside their message in the payload', async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('What is in this picture?', {
    attachments: [{ kind: 'image', ref: 'store://photo-1.png' }],
  });
  const built = await run.build({ now: NOW });
  const [placed] = built.attachmentPlacements;
  assert.equal(built.attachmentPlacements.length, 1);
  let part = built.payload();
  for (const [, name, index] of placed.payload_path.matchAll(/(\w+)\[(\d+)\]/g)) {
    part = part[name][Number(index)];
  }
  assert.match(part.text, /What is in this picture\?/);
  assert.deepEqual(
    placed.attachments.map((a) => [a.attachment.ref, a.content]),
    [['store://photo-1.png', true]],
  );
  assert.ok(!built.providerPayload.includes('photo-1'), 'the engine sends no attachment');
  const image = (send) => ({ type: 'image', source: { type: 'url', url: send.attachment.ref } });
  const sent = JSON.parse(built.payloadWithAttachments(image).toString('utf8'));
  const content = sent.messages.find((m) => m.content.some((b) => b.type === 'image')).content;
  const at = content.findIndex((b) => b.type === 'image');
  assert.equal(content[at].source.url, 'store://photo-1.png');
  assert.match(content[at + 1].text, /What is in this picture\?/, 'just before its text');
  content.splice(at, 1);
  assert.deepEqual(sent, built.payload(), 'nothing else changed');
  // Byte for byte, too: with no parts the payload is the server's, keys in its order.
  assert.ok(built.payloadWithAttachments(() => []).equals(built.providerPayload));
});

test('a payload with attachments keeps the bytes of a schema with integer-like keys', async () => {
  // JSON.stringify would put "9" before "10" (integer-like keys first, numerically); the
  // server's payload, sorted as RFC 8785 sorts, has "10" first.
  const numbered = tool(
    'sheet.read',
    'Read rows.',
    { type: 'object', properties: { 10: { type: 'string' }, 9: { type: 'string' } } },
    { requiredScopes: ['web.read'], sideEffect: 'SIDE_EFFECT_NETWORK_READ' },
  );
  const session = await engine.openSession({
    ...spec,
    tools: [...spec.tools, numbered],
    agent: { ...spec.agent, enabled_tools: ['web.fetch', 'sheet.read'] },
  });
  const run = await session.startRun('Read this.', {
    attachments: [{ kind: 'image', ref: 'store://photo-2.png' }],
  });
  const built = await run.build({ now: NOW });
  assert.ok(built.providerPayload.toString('utf8').includes('"10":'));
  assert.ok(built.payloadWithAttachments(() => []).equals(built.providerPayload));
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

test('a usage report that fails does not lose the final answer', async () => {
  // The report follows the append; one that failed threw out of the loop after the final
  // answer was appended, so the caller lost it (and a second loop appended another).
  const session = await engine.openSession(spec);
  const run = await session.startRun('Home tonight?');
  engine.call = (method, request) =>
    method === 'ReportUsage'
      ? Promise.reject(new UnavailableError(14, 'the engine went away'))
      : ContextEngineClient.prototype.call.call(engine, method, request);
  let result;
  try {
    result = await run.toolLoop({
      now: NOW,
      callModel: async () => ({ text: 'The 18:04.', usage: { inputTokens: 10, outputTokens: 2 } }),
      runTool: async () => assert.fail('no tools'),
    });
  } finally {
    delete engine.call; // the prototype's again
  }
  assert.equal(result.final.text, 'The 18:04.');
  assert.deepEqual(result.reports, []);
  assert.equal(result.unreported.length, 1);
  assert.ok(result.unreported[0].error instanceof UnavailableError);
  assert.equal(run.checkpointVersion, 2); // the one final answer
  const { build, usage } = result.unreported[0];
  assert.ok((await session.reportUsage(build, usage)).samples >= 1);
});

test('a tool loop run again after an append whose answer was lost runs no tool twice', async () => {
  // The append commits but its answer never arrives (a deadline passed while it
  // committed): the loop builds the latest checkpoint, so the model sees the logged result.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const realCall = run.client.call.bind(run.client);
  let lost = false;
  run.client.call = async (method, request) => {
    const response = await realCall(method, request);
    if (method === 'AppendItems' && !lost) {
      lost = true;
      throw new Error("the append's answer was lost");
    }
    return response;
  };
  const ran = [];
  const seen = [];
  const opts = {
    now: NOW,
    callModel: async (build) => {
      seen.push(build);
      const done = build.request.messages
        .flatMap((message) => message.blocks)
        .some((block) => block.kind === 'tool_result');
      if (done) return { text: 'The 08:04.' };
      return { toolCalls: [{ callId: 'c1', name: 'web-fetch', arguments: { url: 'https://x' } }] };
    },
    runTool: async (call) => {
      ran.push(call.callId);
      return '08:04 TGV';
    },
  };
  await assert.rejects(run.toolLoop(opts), /answer was lost/);
  const result = await run.toolLoop(opts);
  assert.deepEqual(ran, ['c1'], 'the tool ran once');
  assert.equal(result.final.text, 'The 08:04.');
  assert.equal(run.checkpointVersion, 3);
});

test('an enum value the proto does not have is refused before it is sent', async () => {
  // proto-loader would send it as 0: a misspelled trust became UNSPECIFIED, which the
  // server reads as the catalog's trusted configuration.
  const misspelled = {
    ...spec,
    skills: [{ name: 'triage', description: 'Sort.', version: '1', trust: 'TRUST_LEVEL_EXTERNAL_UNTRUSED' }],
  };
  await assert.rejects(engine.openSession(misspelled), (error) => {
    assert.ok(error instanceof InvalidArgumentError);
    assert.equal(error.reason, 'INVALID_FIELD');
    assert.equal(error.field, 'spec.skills[0].trust');
    return true;
  });
  for (const kind of [42, '3', 'toString']) {
    // Numbers the enum lacks, a number as a string and an inherited name: all sent as 0.
    await assert.rejects(engine.openSession({ ...spec, environment: { kind } }), (error) => {
      assert.equal(error.field, 'spec.environment.kind', String(kind));
      return true;
    });
  }
  // Known names and numbers pass.
  const session = await engine.openSession({
    ...spec,
    skills: [{ name: 'triage', description: 'Sort.', version: '1', trust: 'TRUST_LEVEL_EXTERNAL_UNTRUSTED' }],
  });
  assert.equal(session.plan.skill_pins.length, 1);
});

test('skills, child runs and working state have methods of their own', async () => {
  const session = await engine.openSession({
    ...spec,
    tools: [...spec.tools, tool('skill.load', 'Load a skill.', { type: 'object' }, { builtin: true })],
    agent: { ...spec.agent, enabled_tools: ['skill.load'] },
    skills: [{ name: 'triage', description: 'Sort the inbox.', version: '1' }],
  });
  const loaded = await session.loadSkill('triage', 'Sort by urgency.');
  assert.deepEqual([loaded.loaded, loaded.newly_loaded], [['triage'], true]);
  assert.equal((await session.loadSkill('triage', 'Sort by urgency.')).newly_loaded, false);
  await assert.rejects(session.loadSkill('triage', 'Another body.'), (error) => {
    assert.ok(error instanceof FailedPreconditionError);
    assert.equal(error.reason, 'SKILL_ALREADY_LOADED');
    return true;
  });

  const parent = await session.startRun('Plan the trip.');
  const child = await session.startChildRun(parent.runId, 'Check the timetable.');
  const built = await child.build({ now: NOW });
  assert.ok(JSON.stringify(built.payload()).includes('Check the timetable.'));

  const updated = await parent.updateWorkingState({ objective: 'Book Paris to Lyon' });
  assert.equal(updated.state.objective.text, 'Book Paris to Lyon');
  assert.equal(parent.checkpointVersion, updated.checkpoint_version);
  assert.equal(parent.checkpointVersion, 2);
});

test('a replayed startRun does not take the session back an epoch', async () => {
  // The resend replays the first answer, rotated_plan included, older by now than
  // session.plan: keeping it would make the next rotate name a stale from_epoch.
  const mail = tool('mail.send', 'Send.', { type: 'object' }, {
    requiredScopes: ['mail.send'],
    sideEffect: 'SIDE_EFFECT_NETWORK_WRITE',
  });
  const session = await engine.openSession({ ...spec, tools: [...spec.tools, mail] });
  const opts = { admission: { scopes: ['mail.send'] }, idempotencyKey: `run-${randomUUID()}` };
  const first = await session.startRun('Mail me.', opts);
  assert.equal(session.plan.epoch, 2); // the admission rotated
  assert.equal((await session.rotate('PLAN_REASON_AGENT_CHANGED')).epoch, 3);
  const again = await session.startRun('Mail me.', opts);
  assert.equal(again.runId, first.runId); // the first answer, replayed
  assert.equal(session.plan.epoch, 3);
  assert.equal((await session.rotate('PLAN_REASON_BUILDER_UPGRADED')).epoch, 4);
});

test("a child's continued lineage does not become the session's plan", async () => {
  // A child of a run parked behind a sweep continues its parent's lineage first, and
  // StartRun returns that continuation as rotated_plan; session.plan stays the current
  // plan, so the next rotate names it as from_epoch instead of failing EPOCH_CONFLICT.
  const mail = tool('mail.send', 'Send.', { type: 'object' }, {
    requiredScopes: ['mail.send'],
    sideEffect: 'SIDE_EFFECT_NETWORK_WRITE',
  });
  const session = await engine.openSession({ ...spec, tools: [...spec.tools, mail] });
  assert.deepEqual(session.unknownToolNames, []);
  const parked = await session.startRun('Trains to Lyon?'); // epoch 1
  await session.startRun('Mail me.', { admission: { scopes: ['mail.send'] } });
  const swept = await session.rotate('PLAN_REASON_AGENT_CHANGED'); // a sweep: epoch 3
  const child = await session.startChildRun(parked.runId, 'Look up the timetable.');
  assert.equal(child.epoch, 4); // lineage 1 continued
  assert.equal(session.plan.epoch, swept.epoch);
  assert.equal(swept.epoch, 3);
  const plan = await session.rotate('PLAN_REASON_BUILDER_UPGRADED');
  assert.equal(plan.epoch, 5);
  assert.equal((await engine.session(session.sessionId)).plan.epoch, 5);
  session.plan = swept; // as a stale copy would have it
  assert.equal((await session.refreshPlan()).epoch, 5);
  assert.equal(session.plan.epoch, 5);
  assert.equal((await session.refreshPlan(1)).epoch, 1);
  assert.equal(session.plan.epoch, 5); // an older epoch read is not the current plan
  // A rotate's spec names its own unknown tools, which the session now reports.
  const typo = { ...spec, agent: { ...spec.agent, enabled_tools: ['web.fetch', 'web.fetchh'] } };
  await session.rotate('PLAN_REASON_AGENT_CHANGED', { spec: typo });
  assert.deepEqual(session.unknownToolNames, ['web.fetchh']);
  await session.rotate('PLAN_REASON_BUILDER_UPGRADED'); // no spec: the pinned one's stand
  assert.deepEqual(session.unknownToolNames, ['web.fetchh']);
});

test('a spent deadline is a DeadlineExceededError', async () => {
  const hurried = new ContextEngineClient({ target, tenantId: 'tenant-client-ts', timeoutMs: 0.001 });
  await assert.rejects(hurried.openSession(spec), (error) => {
    assert.ok(error instanceof DeadlineExceededError, error.name);
    return true;
  });
  hurried.close();
});

test('errors are typed with reason and field', async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('Hello');

  await assert.rejects(run.append([toolResult('never-called', 'web.fetch', 'x')]), (error) => {
    assert.ok(error instanceof InvalidArgumentError);
    assert.equal(error.reason, 'ORPHANED_TOOL_ITEM');
    assert.equal(error.field, 'items[0].tool_result.call_id');
    // The key the wrapper made travels with the error, for a resend that must reuse it.
    assert.ok(error.idempotencyKey.length > 0);
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
    assert.equal(error.idempotencyKey, ''); // GetPlan sends none
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

test('ErrorInfo metadata is decoded', async () => {
  const big = { ...spec, agent: { ...spec.agent, instructions: 'word '.repeat(40_000) } };
  await assert.rejects(engine.openSession(big), (error) => {
    assert.ok(error instanceof FailedPreconditionError, String(error));
    assert.equal(error.reason, 'PREFIX_CLASS_OVER_CAP');
    assert.equal(error.metadata.class, 'agent_instructions');
    return true;
  });
});

// --- retries: a write whose answer is lost ---------------------------------------------

// A TCP proxy between client and server. Armed, it drops both connections at the first
// response HEADERS frame (HTTP/2 type 1 on a stream) the server sends: the server has
// answered, so the call was carried out, yet the client sees its connection drop before
// any response, as after a sidecar restart or a network blip: UNAVAILABLE, which the
// channel's retry policy resends.
async function answerDroppingProxy() {
  const [host, port] = target.split(':');
  const proxy = { armed: false, dropped: 0 };
  proxy.server = net.createServer((client) => {
    const server = net.connect(Number(port), host);
    let pending = Buffer.alloc(0);
    client.on('data', (data) => server.write(data));
    server.on('data', (data) => {
      // A server's side of an HTTP/2 connection is frames from its first byte: a 9-byte
      // header (24-bit length, type, flags, stream id), then the payload.
      pending = Buffer.concat([pending, data]);
      while (pending.length >= 9 && pending.length >= 9 + pending.readUIntBE(0, 3)) {
        const end = 9 + pending.readUIntBE(0, 3);
        const frame = pending.subarray(0, end);
        pending = pending.subarray(end);
        if (proxy.armed && frame[3] === 1 && (frame.readUInt32BE(5) & 0x7fffffff) !== 0) {
          proxy.armed = false;
          proxy.dropped += 1;
          client.destroy();
          server.destroy();
          return;
        }
        client.write(frame);
      }
    });
    for (const [one, other] of [[client, server], [server, client]]) {
      one.on('error', () => {});
      one.on('close', () => other.destroy());
    }
  });
  await new Promise((resolve) => proxy.server.listen(0, '127.0.0.1', resolve));
  proxy.engine = new ContextEngineClient({
    target: `127.0.0.1:${proxy.server.address().port}`,
    tenantId: `tenant-node-${randomUUID()}`,
  });
  proxy.close = () => {
    proxy.engine.close();
    proxy.server.close();
  };
  return proxy;
}

test('a rotation whose answer is lost is resent and answers with its plan', async () => {
  const proxy = await answerDroppingProxy();
  try {
    const session = await proxy.engine.openSession(spec);
    proxy.armed = true;
    const plan = await session.rotate('PLAN_REASON_AGENT_CHANGED', { detail: 'v2' });
    assert.equal(proxy.dropped, 1);
    assert.equal(plan.epoch, 2);
    assert.equal((await proxy.engine.session(session.sessionId)).plan.epoch, 2);
    // A rotation from the epoch it left is a lost race, with the current epoch named.
    const stale = await proxy.engine.session(session.sessionId, 1);
    await assert.rejects(stale.rotate('PLAN_REASON_AGENT_CHANGED'), (error) => {
      assert.ok(error instanceof AbortedError, String(error));
      assert.equal(error.reason, 'EPOCH_CONFLICT');
      assert.equal(error.metadata.current_epoch, '2');
      return true;
    });
  } finally {
    proxy.close();
  }
});

test('an offer whose answer is lost is recorded once', async () => {
  const proxy = await answerDroppingProxy();
  try {
    const session = await proxy.engine.openSession(spec);
    const earlier = await session.offerFactCandidates();
    proxy.armed = true;
    const offered = await session.offerFactCandidates();
    assert.equal(proxy.dropped, 1);
    // One event between: the resend answered with the first attempt's offer.
    assert.equal(offered.event_sequence, earlier.event_sequence + 1);
  } finally {
    proxy.close();
  }
});

test('a compaction retried by hand with its key lands once', async () => {
  const reserve = 1024;
  const probe = await engine.openSession(spec);
  const session = await engine.openSession({
    ...spec,
    reserve_output_tokens: reserve,
    policy_cap_tokens: probe.plan.prefix_tokens + reserve + 4_000,
  });
  const first = await session.startRun('Tell me everything.');
  await first.append([assistantMessage(Array(6_000).fill('lorem').join(' '))]);
  const run = await session.startRun('And now?');
  assert.equal((await run.build({ now: NOW })).needsCompaction, true);
  const summarize = async () => 'The assistant said a lot of lorem.';
  const before = run.checkpointVersion;
  const compacted = await run.compact(summarize, { idempotencyKey: 'compact-1' });
  assert.equal(compacted, before + 1);
  // The first attempt's answer was lost: its Run still holds the version it compacted.
  const retry = session.run(run.runId, before);
  assert.equal(await retry.compact(summarize, { idempotencyKey: 'compact-1' }), compacted);
  assert.equal((await run.build({ now: NOW })).needsCompaction, false);
});
