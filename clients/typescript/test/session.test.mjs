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

import * as grpc from '@grpc/grpc-js';

import {
  AbortedError,
  AuthError,
  ClientError,
  BuildResult,
  ContextEngineClient,
  ContextEngineError,
  DeadlineExceededError,
  FailedPreconditionError,
  InternalError,
  InvalidArgumentError,
  NotFoundError,
  ResourceExhaustedError,
  Run,
  Session,
  UnavailableError,
  argumentsProblem,
  assistantMessage,
  protoPackage,
  tool,
  toolCall,
  toolResult,
  userMessage,
  wireToolName,
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

test('a call on a closed client rejects with a ClientError', async () => {
  // grpc-js throws before sending on a closed channel; it surfaced as a plain Error.
  const closed = new ContextEngineClient({ target, tenantId: 't' });
  closed.close();
  await assert.rejects(
    closed.call('GetPlan', { tenant_id: 't', session_id: randomUUID() }),
    (error) => error instanceof ClientError && /GetPlan/.test(error.message),
  );
});

test('a result cut through an emoji is sent, its half pair as U+FFFD', async () => {
  // '🚄' is a surrogate pair; slice(0, 3) keeps 'ab' and its first half only. Encoded as
  // it was, the request did not decode and the engine refused it naming no field.
  const cut = 'ab🚄 08:04'.slice(0, 3);
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains?');
  await run.append([
    toolCall('call-1', 'web.fetch', { url: 'https://trains.example' }),
    toolResult('call-1', 'web.fetch', 'ab🚄 08:04', { contextContent: cut }),
  ]);
  const built = await run.build({ now: NOW });
  const results = built.request.messages.flatMap((m) => m.blocks).filter((b) => b.tool_result);
  assert.ok(results[0].tool_result.content.includes('ab\uFFFD'));
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

test('a call the engine cannot log is answered, not run', async () => {
  // Arguments the engine refuses to log (cut off, not an object, a 64-bit integer) and a
  // tool output holding U+0000 failed the step's append after its tools had run, and the
  // loop's retry ran them again (a review). Such a call is logged with no arguments and
  // answered as an error, never run; U+0000 is sent as U+FFFD; the step lands.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const ran = [];
  let turns = 0;
  const result = await run.toolLoop({
    now: NOW,
    callModel: async () => {
      turns += 1;
      if (turns > 1) return { text: 'Done.' };
      return {
        text: 'Checking\u0000 now.',
        toolCalls: [
          { callId: 'cut', name: 'web-fetch', arguments: '{"url": "https://tra' },
          { callId: 'list', name: 'web-fetch', arguments: '["https://trains.example"]' },
          { callId: 'big', name: 'web-fetch', arguments: '{"url": "x", "id": 18446744073709551615}' },
          { callId: 'ok', name: 'web-fetch', arguments: { url: 'https://trains.example' } },
          // None, as providers send it for a tool without parameters: the engine's {}.
          { callId: 'none', name: 'web-fetch', arguments: '' },
        ],
      };
    },
    runTool: async (call) => {
      ran.push(call.callId);
      return { content: '08:04 TGV\u00006601', source: 'tool:web.fetch' };
    },
  });
  assert.equal(argumentsProblem({ url: 'x' }), '');
  assert.equal(argumentsProblem('{"a": 1e300}'), '', 'as the engine reads it');
  assert.equal(result.final.text, 'Done.');
  assert.deepEqual(ran, ['ok', 'none']);
  const told = JSON.stringify(result.builds[1].request);
  assert.equal(told.split("Not run: the call's arguments").length - 1, 3);
  assert.ok(told.includes('are not a JSON object') && told.includes('beyond 2^53 - 1'));
  assert.ok(told.includes('08:04 TGV\uFFFD6601') && told.includes('Checking\uFFFD now.'));
});

test('an integer literal past 2^53 - 1 is refused as written, as the engine refuses it', async () => {
  // JSON.parse rounds a 24-digit order id to a double of 1e21 or more, which the check
  // passed: the tool ran, the engine (reading the literal exactly) refused the step's
  // append, and each retry ran the tool again (an audit). Each row is appended as it is,
  // so the engine itself says which it takes.
  const rows = [
    '{"order_id":123456789012345678901234}',
    '{"a":[1,-12345678901234567890123]}',
    '{"a":9007199254740992}',
    '{"a":1e400}',
    '{"a":9007199254740991,"b":-9007199254740991}',
    '{"a":123456789012345678901234.0,"b":1.5e300,"c":-1E+22}',
    '{"id":"123456789012345678901234","q":"\\"123456789012345678901234"}',
    '{"123456789012345678901234":0}',
  ];
  const session = await engine.openSession(spec);
  const run = await session.startRun('Refund order 123456789012345678901234?');
  for (const [n, args] of rows.entries()) {
    const problem = argumentsProblem(args);
    const appended = await run
      .append([toolCall(`c${n}`, 'web.fetch', args), toolResult(`c${n}`, 'web.fetch', 'ok')])
      .then(() => '', (error) => `${error.reason} ${error.field}`);
    const refused = appended ? 'INVALID_FIELD items[0].tool_call.arguments_json' : '';
    assert.equal(appended, refused, args);
    assert.equal(problem !== '', refused !== '', `${args}: ${problem || 'taken'}`);
  }
  assert.match(argumentsProblem(rows[0]), /beyond 2\^53 - 1/);
  const ran = [];
  let turns = 0;
  const result = await run.toolLoop({
    now: NOW,
    callModel: async () =>
      (turns += 1) > 1
        ? { text: 'Done.' }
        : { toolCalls: [{ callId: 'big', name: 'web-fetch', arguments: rows[0] }] },
    runTool: async (call) => {
      ran.push(call.callId);
      return { content: 'Refunded.' };
    },
  });
  assert.deepEqual(ran, [], 'answered, not run');
  assert.equal(result.final.text, 'Done.');
});

const THINKING = Buffer.from(JSON.stringify({ type: 'thinking', thinking: 'Hmm.', signature: 's' }));

/** The run's tool calls a build shows, in order. */
const loggedCalls = (build, run) =>
  build.request.messages
    .flatMap((message) => message.blocks)
    .filter((block) => block.kind === 'tool_call' && block.run_id === run.runId)
    .map((block) => block.tool_call);

test('a turn the engine cannot log runs no tool, and throws with the turn', async () => {
  // A call whose id the engine refuses (empty, over 200 characters, used twice in the
  // run) or that names no tool, and a reasoning item it cannot replay, ran the step's
  // tools, then the append was refused INVALID_FIELD: the results were lost, the pending
  // request could not be resent, and the next toolLoop ran the tools again (an audit).
  const call = (callId, url = 'https://trains.example') => ({
    callId,
    name: 'web-fetch',
    arguments: { url },
  });
  const cases = {
    'no call id': [call('ok'), call('')],
    'a call id over 200 characters': [call('ok'), call('c'.repeat(201))],
    'a call id twice in the turn': [call('c1'), call('c1', 'https://other')],
    'a call id of an earlier step': null,
    'no tool name': [call('ok'), { callId: 'c2', name: '', arguments: {} }],
    'a reasoning item the engine cannot replay': [call('ok')],
  };
  for (const [name, calls] of Object.entries(cases)) {
    const session = await engine.openSession(spec);
    const run = await session.startRun('Trains to Lyon?');
    const ran = [];
    let turns = 0;
    const error = await run
      .toolLoop({
        now: NOW,
        callModel: async () => {
          turns += 1;
          const usage = { inputTokens: 10, outputTokens: 5 };
          // Some providers number their calls per response: call_0 again at step two.
          if (!calls) return { toolCalls: [call('call_0', `https://t/${turns}`)], usage };
          const reasoning = [{ provider: 'PROVIDER_ANTHROPIC', opaque: THINKING }];
          if (name.startsWith('a reasoning')) {
            reasoning.push({ provider: 'PROVIDER_ANTHROPIC', opaque: Buffer.from('{"type":"thinking"}') });
          }
          return { text: 'Looking.', toolCalls: calls, reasoning, usage };
        },
        runTool: async (c) => {
          ran.push(c.callId);
          return { content: '08:04 TGV 6601', source: 'tool:web.fetch' };
        },
      })
      .then(
        () => assert.fail(`${name}: the loop went on`),
        (e) => e,
      );
    assert.ok(error instanceof ClientError && !(error instanceof ContextEngineError), `${name}: ${error}`);
    assert.match(error.message, /cannot be logged: .*no tool was run/, name);
    assert.deepEqual(ran, calls ? [] : ['call_0'], name);
    assert.equal(error.final, false, name);
    assert.ok(error.turn.toolCalls.length, name);
    assert.equal(error.pendingRequest, undefined, name);
    assert.deepEqual(error.unreported, [], `${name}: its usage was reported`);
    assert.equal(error.builds.length, turns, name);
    const logged = loggedCalls(await run.build({ now: NOW }), run).map((c) => c.call_id);
    assert.deepEqual(logged, ran, name);
  }
});

test('an item id the engine refuses is logged as none; a task id of no task is dropped', async () => {
  // A provider item id over 200 characters or holding whitespace, and a call's task id
  // naming no task of the run's working state, failed the step's append after its tools
  // had run (an audit). The ids only pair replayed reasoning (the model cannot correct
  // them): logged as none. The task id, which only the append can check, is dropped and
  // the step sent again under its key (as the proto says to): the tools run once, a task
  // the state holds still moves.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  await run.updateWorkingState({ upsert_tasks: [{ task_id: 't1', title: 'Find a train' }] });
  const ran = [];
  const keys = [];
  let turns = 0;
  const spy = (method, request, opts, real) => {
    if (method === 'AppendItems') keys.push(request.idempotency_key);
    return real(method, request, opts);
  };
  const result = await withCall(spy, () =>
    run.toolLoop({
      now: NOW,
      callModel: async () => {
        turns += 1;
        if (turns > 1) return { text: 'Done.' };
        const call = (callId, extra) => ({ callId, name: 'web-fetch', arguments: { url: callId }, ...extra });
        return {
          text: 'Looking.',
          textItemId: 'msg\t1',
          toolCalls: [
            call('c1', { providerItemId: 'fc 1', taskId: 't-unknown' }),
            call('c2', { providerItemId: 'f'.repeat(201), taskId: 't1' }),
            call('c3', { providerItemId: 'fc\u20283', taskId: 't-other' }),
            call('c4', { providerItemId: 'fc_4' }),
          ],
        };
      },
      runTool: async (c) => {
        ran.push(c.callId);
        return { content: 'page', source: 'tool:web.fetch' };
      },
    }),
  );
  assert.equal(result.final.text, 'Done.');
  assert.deepEqual(ran, ['c1', 'c2', 'c3', 'c4']);
  // Refused naming c1's task, then c3's; sent a third time, under the step's one key.
  assert.equal(keys.length, 4);
  assert.equal(new Set(keys.slice(0, 3)).size, 1);
  const logged = loggedCalls(result.builds[1], run).map((c) => [c.call_id, c.provider_item_id]);
  assert.deepEqual(logged, [['c1', ''], ['c2', ''], ['c3', ''], ['c4', 'fc_4']]);
  const text = result.builds[1].request.messages
    .flatMap((message) => message.blocks)
    .filter((block) => block.kind === 'text' && block.text === 'Looking.')
    .map((block) => block.provider_item_id);
  assert.deepEqual(text, ['']);
  assert.ok(JSON.stringify(result.builds[1].request).includes('Task \\"t1\\" (done)'));
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

test("the tool loop relays the model's control calls itself; a refusal goes back to the model", async () => {
  const controls = await engine.listControlTools();
  const session = await engine.openSession({ ...spec, tools: [...spec.tools, ...controls] });
  const run = await session.startRun('Trains to Lyon, never at night.');
  const wire = wireToolName('context.update_working_state');
  const seen = [];
  const text = (build) => JSON.stringify(build.request);
  const result = await run.toolLoop({
    now: NOW,
    callModel: async (build) => {
      seen.push(build);
      const userId = /<user source=\\"user\\" id=\\"([^"\\]+)/.exec(text(build))[1];
      const fact = { statement: 'The user avoids night trains' };
      if (seen.length === 3) return { text: 'Noted: day trains only.' };
      // First an id no envelope shows, then the user's message's.
      const ids = seen.length === 1 ? ['u-99'] : [userId];
      const args = { add_facts: [{ ...fact, source_item_ids: ids }] };
      return { toolCalls: [{ callId: `c${seen.length}`, name: wire, arguments: args }] };
    },
    runTool: async (call) => assert.fail(`${call.name} is the engine's to run`),
  });
  assert.equal(result.final.text, 'Noted: day trains only.');
  // In an envelope: the refusal quotes the model's words, and no fact rests on it as trusted.
  assert.match(text(seen[1]), /<untrusted source=\\"engine:context.update_working_state\\"[^>]*>\\nNot applied \(INVALID_FIELD at update\.add_facts\[0\]\.source_item_ids\[0\]\)[^\\]*u-99/);
  // The server's own words, as the Python client relays them (a review: the code name and
  // the reason were added, so the two clients logged different bytes).
  assert.match(
    text(seen[1]),
    /Not applied \(INVALID_FIELD at update\.add_facts\[0\]\.source_item_ids\[0\]\): item 'u-99'/,
  );
  assert.match(text(seen[2]), /Established[^\n]*The user avoids night trains/);
});

test('a control call the build did not offer goes to runTool', async () => {
  const session = await engine.openSession(spec); // no control tools
  const run = await session.startRun('Trains to Lyon?');
  const ran = [];
  await run.toolLoop({
    now: NOW,
    callModel: async () =>
      ran.length
        ? { text: 'Done.' }
        : { toolCalls: [{ callId: 'w1', name: 'context.update_working_state', arguments: { objective: 'INJECTED' } }] },
    runTool: async (call) => {
      ran.push(call.name);
      return { content: 'No such tool.', isError: true };
    },
  });
  assert.deepEqual(ran, ['context.update_working_state']);
});

test('a usage report that fails does not lose the final answer', async () => {
  // The report follows the append; one that failed threw out of the loop after the final
  // answer was appended, so the caller lost it (and a second loop appended another).
  const session = await engine.openSession(spec);
  const run = await session.startRun('Home tonight?');
  engine.call = (method, request, opts) =>
    method === 'ReportUsage'
      ? Promise.reject(new UnavailableError(14, 'the engine went away'))
      : ContextEngineClient.prototype.call.call(engine, method, request, opts);
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

test('a refused usage report is kept too, and an error ending the loop carries what it kept', async () => {
  // A refused report threw after the final answer was appended (an audit), and any error
  // out of the loop dropped the reports it had not sent.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Home tonight?');
  const refused = await run.toolLoop({
    now: NOW,
    callModel: async () => ({ text: 'Done.', usage: { inputTokens: -1, outputTokens: 2 } }),
    runTool: async () => assert.fail('no tools'),
  });
  assert.equal(refused.final.text, 'Done.');
  assert.equal(refused.unreported.length, 1);
  assert.ok(refused.unreported[0].error instanceof InvalidArgumentError);
  assert.equal(refused.unreported[0].error.retryable, false);

  const other = await session.startRun('And tomorrow?');
  let appends = 0;
  other.client.call = (method, request, opts) => {
    if (method === 'ReportUsage') return Promise.reject(new UnavailableError(14, 'gone'));
    if (method === 'AppendItems' && ++appends === 2) {
      return Promise.reject(new InternalError(13, 'a proxy failed'));
    }
    return ContextEngineClient.prototype.call.call(other.client, method, request, opts);
  };
  try {
    const error = await other
      .toolLoop({
        now: NOW,
        callModel: async (build) =>
          build.request.messages.flatMap((m) => m.blocks).some((b) => b.kind === 'tool_result')
            ? { text: 'The 08:04.', usage: { inputTokens: 10, outputTokens: 2 } }
            : {
                toolCalls: [{ callId: 'c1', name: 'web-fetch', arguments: { url: 'https://x' } }],
                usage: { inputTokens: 10, outputTokens: 2 },
              },
        runTool: async () => '08:04 TGV',
      })
      .then(() => assert.fail('the second append fails'), (e) => e);
    assert.ok(error instanceof InternalError);
    // Step one's report, and step two's: its append failed, the model's tokens were spent
    // all the same (an audit: that usage was lost).
    assert.equal(error.unreported.length, 2);
    assert.ok(error.unreported.every((u) => u.error instanceof UnavailableError));
    assert.equal(error.builds.length, 2);
    // The step's turn, and that it was the final answer: resend it and stop.
    assert.equal(error.final, true);
    assert.equal(error.turn.text, 'The 08:04.');
  } finally {
    delete other.client.call; // the prototype's again
  }
});

test("a step's append that meets a later write goes after it and runs no tool twice", async () => {
  // The user's next message lands on the run while its tool runs: the append was refused
  // CHECKPOINT_VERSION_CONFLICT with a request that could never be resent (an audit).
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const ran = [];
  const result = await run.toolLoop({
    now: NOW,
    callModel: async (build) =>
      build.request.messages.flatMap((m) => m.blocks).some((b) => b.kind === 'tool_result')
        ? { text: 'The 08:04.' }
        : { toolCalls: [{ callId: 'c1', name: 'web-fetch', arguments: { url: 'https://x' } }] },
    runTool: async (call) => {
      ran.push(call.callId);
      const other = session.run(run.runId, run.checkpointVersion);
      await other.append([userMessage('Actually, Marseille.')]);
      return '08:04 TGV';
    },
  });
  assert.deepEqual(ran, ['c1']);
  assert.equal(result.final.text, 'The 08:04.');
  assert.equal(run.checkpointVersion, 4);
});

test('a final answer overtaken by a later write is asked again, not appended after it', async () => {
  // Rebased after the user's next message, the stale answer left that message unanswered
  // and the loop returned as if done (an audit).
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const asked = [];
  const result = await run.toolLoop({
    now: NOW,
    callModel: async (build) => {
      const fetched = build.request.messages
        .flatMap((m) => m.blocks)
        .some((b) => b.kind === 'tool_result');
      if (!fetched) {
        return {
          toolCalls: [{ callId: 'c1', name: 'web-fetch', arguments: { url: 'https://x' } }],
          usage: { inputTokens: 10, outputTokens: 2 },
        };
      }
      asked.push(build);
      if (asked.length === 1) {
        const other = session.run(run.runId, run.checkpointVersion);
        await other.append([userMessage('Actually, Marseille.')]);
      }
      return { text: `Answer ${asked.length}.`, usage: { inputTokens: 10, outputTokens: 2 } };
    },
    runTool: async () => '08:04 TGV',
  });
  assert.equal(asked.length, 2);
  assert.equal(result.final.text, 'Answer 2.');
  assert.ok(asked[1].providerPayload.toString().includes('Marseille'));
  assert.equal(result.reports.length, 3); // the overtaken answer's tokens were spent too
  // The step, the user's message, the one answer.
  assert.equal(run.checkpointVersion, 4);
});

test('a tool that throws still reports the model usage', async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const error = await run
    .toolLoop({
      now: NOW,
      callModel: async () => ({
        toolCalls: [{ callId: 'c1', name: 'web-fetch', arguments: { url: 'https://x' } }],
        usage: { inputTokens: 10, outputTokens: 2 },
      }),
      runTool: async () => {
        throw new Error("the tool's backend is down");
      },
    })
    .then(() => assert.fail('the tool throws'), (e) => e);
  assert.equal(error.final, false);
  assert.equal(error.unreported.length, 0); // reported: it was lost before (an audit)
  const report = await session.reportUsage(error.builds[0], error.turn.usage);
  assert.ok(report.samples >= 1); // the same key: the report landed once
});

test('a token is checked before it is sent, and no deadline is no deadline', async () => {
  // A bearer token went in clear to any target, one with a line ending threw grpc-js's
  // own error synchronously at the first call, and timeoutMs 0 was a deadline already
  // past (an audit).
  const token = 't'.repeat(32);
  for (const remote of ['10.1.2.3:50051', 'engine.example:443', 'ipv4:127.0.0.1:1,10.0.0.1:1']) {
    assert.throws(() => new ContextEngineClient({ target: remote, tenantId: 't', token }), /in clear/);
    new ContextEngineClient({ target: remote, tenantId: 't', token, allowInsecureToken: true }).close();
  }
  for (const local of ['127.0.0.1:1', 'localhost:1', '[::1]:1', 'unix:/tmp/engine.sock']) {
    new ContextEngineClient({ target: local, tenantId: 't', token }).close();
  }
  // IPv4-mapped loopback is loopback, as in the Python and Go clients.
  for (const mapped of ['[::ffff:127.0.0.1]:1', 'ipv6:[::ffff:127.0.0.1]:1']) {
    new ContextEngineClient({ target: mapped, tenantId: 't', token }).close();
  }
  assert.throws(
    () => new ContextEngineClient({ target: '127.0.0.1:1', tenantId: 't', token: `${token}\n` }),
    /header value/,
  );
  assert.throws(() => new ContextEngineClient({ target: '127.0.0.1:1', tenantId: '' }), /tenantId/);
  new ContextEngineClient({ target: '127.0.0.1:1', tenantId: '', token }).close();
  assert.throws(() => new ContextEngineClient({ target, tenantId: 't', timeoutMs: -1 }));
  for (const timeoutMs of [0, Infinity]) {
    const unbounded = new ContextEngineClient({ target, tenantId: engine.tenantId, timeoutMs });
    try {
      assert.ok((await unbounded.openSession(spec)).created);
    } finally {
      unbounded.close();
    }
  }
});

test('insecure credentials are plaintext: a token goes over them to a loopback target only', () => {
  // createInsecure() passed as credentials skipped the check, and the token went in clear
  // to any target (an audit).
  const token = 't'.repeat(32);
  const credentials = grpc.credentials.createInsecure();
  const remote = '10.1.2.3:50051';
  assert.throws(
    () => new ContextEngineClient({ target: remote, tenantId: 't', token, credentials }),
    /in clear/,
  );
  for (const options of [
    { target: remote, allowInsecureToken: true, credentials },
    { target: '127.0.0.1:1', credentials },
    { target: remote, credentials: grpc.credentials.createSsl() },
  ]) {
    new ContextEngineClient({ tenantId: 't', token, ...options }).close();
  }
});

test('a negative or NaN deadline of a call is refused, as the client-wide one is', async () => {
  // A negative deadlineMs was a deadline already past (DEADLINE_EXCEEDED), and NaN fell
  // back to the client's, where timeoutMs -1 or NaN throws (an audit).
  for (const deadlineMs of [-1, NaN]) {
    for (const call of [
      () => engine.call('ListControlTools', {}, { deadlineMs }),
      () => engine.openSession(spec, { deadlineMs }),
    ]) {
      await assert.rejects(call(), (error) => {
        assert.ok(error instanceof TypeError, error.name);
        assert.match(error.message, /deadlineMs must be 0 \(no deadline\) or more/);
        return true;
      });
    }
  }
});

test('a request that is not an object is refused before it is sent, never crashing', async () => {
  // run.resendAppend(undefined) was sent; the answer's callback then threw reading the
  // request's key, outside any promise: the process died (an audit).
  const session = await engine.openSession(spec);
  const run = await session.startRun('Hello');
  for (const request of [undefined, null, 'AppendItems', []]) {
    await assert.rejects(run.resendAppend(request), (error) => {
      assert.ok(error instanceof TypeError, error.name);
      assert.match(error.message, /^AppendItems: request must be an object \(not sent\)$/);
      return true;
    });
  }
  assert.equal(run.checkpointVersion, 1);
});

test("openSession with sessionId '' opens a session under a new id, as Python's does", async () => {
  // It sent the empty id, which the engine refused (an audit).
  const session = await engine.openSession(spec, { sessionId: '' });
  assert.match(session.sessionId, /^[0-9a-f-]{36}$/);
  assert.ok(session.created);
});

test('a resend of an old append does not take the version back; openSession errors carry the id', async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('Hello');
  const key = randomUUID();
  await run.append([assistantMessage('One.')], key);
  await run.append([assistantMessage('Two.')]);
  assert.equal(run.checkpointVersion, 3);
  const request = {
    tenant_id: engine.tenantId,
    session_id: session.sessionId,
    run_id: run.runId,
    expected_checkpoint_version: 1,
    idempotency_key: key,
    items: [assistantMessage('One.')],
  };
  assert.equal((await run.resendAppend(request)).checkpoint_version, 2);
  assert.equal(run.checkpointVersion, 3);
  const error = await engine
    .openSession({ ...spec, model_id: 'no-such-model' })
    .then(() => assert.fail('refused'), (e) => e);
  assert.ok(error instanceof InvalidArgumentError);
  assert.match(error.sessionId, /^[0-9a-f-]{36}$/);
});

test('a tool loop run again after an append whose answer was lost runs no tool twice', async () => {
  // The append commits but its answer never arrives (a deadline passed while it
  // committed): the loop builds the latest checkpoint, so the model sees the logged result.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const realCall = ContextEngineClient.prototype.call.bind(run.client);
  let lost = false;
  run.client.call = async (method, request, callOpts) => {
    const response = await realCall(method, request, callOpts);
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
  try {
    await assert.rejects(run.toolLoop(opts), /answer was lost/);
    const result = await run.toolLoop(opts);
    assert.deepEqual(ran, ['c1'], 'the tool ran once');
    assert.equal(result.final.text, 'The 08:04.');
    assert.equal(run.checkpointVersion, 3);
  } finally {
    delete run.client.call; // the prototype's again
  }
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
    assert.deepEqual([stale.plan.epoch, stale.requestedPlan.epoch], [2, 1]);
    stale.plan = stale.requestedPlan; // as a stale copy would have it
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

// --- the model that answered, resent appends, deadlines, epochs --------------------------

/** Replaces engine.call for one test; `spy(method, request, opts, real)` answers. */
async function withCall(spy, body) {
  const real = (method, request, opts) =>
    ContextEngineClient.prototype.call.call(engine, method, request, opts);
  engine.call = (method, request, opts) => spy(method, request, opts, real);
  try {
    return await body();
  } finally {
    delete engine.call; // the prototype's again
  }
}

/** A model that answers at once with the usage Build estimated, as `model`. */
const answering = (model) => async (build) => ({
  text: 'The 08:04.',
  usage: { inputTokens: build.response.estimated_input_tokens, outputTokens: 5 },
  model,
});

test('usage is reported under the model that answered', async () => {
  // ReportUsage named the planned model whatever answered, so the engine learnt from a
  // report of another model; another model's report is recorded but moves no factor.
  const session = await engine.openSession(spec);
  const sent = [];
  const spy = (method, request, opts, real) => {
    if (method === 'ReportUsage') sent.push(request.model_id);
    return real(method, request, opts);
  };
  const loop = async (model) =>
    (await session.startRun('Lyon?')).toolLoop({
      now: NOW,
      callModel: answering(model),
      runTool: async () => assert.fail('no tools'),
    });
  const [other, dated, planned] = await withCall(spy, async () => [
    await loop('gpt-4o'),
    await loop('claude-sonnet-4-5-20250929'),
    await loop(undefined),
  ]);
  assert.deepEqual(sent, ['gpt-4o', 'claude-sonnet-4-5-20250929', 'claude-sonnet-4-5']);
  assert.equal(other.reports[0].absorbed, false, 'recorded, not learnt from');
  assert.equal(dated.reports[0].absorbed, true, 'a dated snapshot counts as the model');
  assert.equal(planned.reports[0].absorbed, true);
});

const fetchOnce = () => {
  const ran = [];
  const seen = [];
  return {
    ran,
    opts: {
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
    },
  };
};

test("a step's append that fails is resent with the same key", async () => {
  // It threw out of the loop with its key: the caller could only ask the model and run
  // the tools again. The first attempt lands with its answer lost, the second cannot
  // reach the engine, the third replays the first answer.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const keys = [];
  const deadlines = [];
  const spy = async (method, request, opts, real) => {
    if (method === 'AppendItems') {
      keys.push(request.idempotency_key);
      deadlines.push(opts.deadlineMs);
      if (keys.length === 1) {
        await real(method, request, opts);
        throw new DeadlineExceededError(4, 'answer lost');
      }
      if (keys.length === 2) throw new UnavailableError(14, 'the engine went away');
    }
    return real(method, request, opts);
  };
  const { ran, opts } = fetchOnce();
  const result = await withCall(spy, () => run.toolLoop({ ...opts, deadlineMs: 5_000 }));
  assert.equal(result.final.text, 'The 08:04.');
  assert.deepEqual(ran, ['c1']);
  assert.equal(keys.length, 4);
  assert.equal(new Set(keys.slice(0, 3)).size, 1, 'the same key each time');
  assert.notEqual(keys[3], keys[0]);
  // Doubled after the DEADLINE_EXCEEDED (a longer deadline, as docs/api.md says to retry
  // with), not after the UNAVAILABLE; the next step's append starts anew.
  assert.deepEqual(deadlines, [5_000, 10_000, 10_000, 5_000]);
  assert.equal(run.checkpointVersion, 3, 'the pair once, then the answer');
});

test('a busy session is retryable: the loop resends and keeps the answer', async () => {
  // ABORTED SESSION_BUSY wrote nothing: unlike a lost race it is retryable, so the loop
  // resends the step's append unchanged and keeps a usage report that met it in
  // `unreported` instead of throwing past the appended final answer (a client audit).
  // A result naming no tool takes its call's on the server, which names the source by it.
  assert.equal(toolResult('c1', '', 'x').tool_result.source, '');
  assert.equal(toolResult('c1', 'web.fetch', 'x').tool_result.source, 'tool:web.fetch');
  const busy = new AbortedError(10, 'busy', 'SESSION_BUSY');
  assert.ok(busy.retryable);
  assert.ok(!new AbortedError(10, 'moved', 'CHECKPOINT_VERSION_CONFLICT').retryable);
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const keys = [];
  const spy = async (method, request, opts, real) => {
    if (method === 'AppendItems') {
      keys.push(request.idempotency_key);
      if (keys.length === 1) throw busy;
    }
    if (method === 'ReportUsage') throw busy;
    return real(method, request, opts);
  };
  const { ran, opts } = fetchOnce();
  const turn = opts.callModel;
  const usage = { inputTokens: 10, outputTokens: 2 };
  const withUsage = { ...opts, callModel: async (build) => ({ ...(await turn(build)), usage }) };
  const result = await withCall(spy, () => run.toolLoop(withUsage));
  assert.equal(result.final.text, 'The 08:04.');
  assert.deepEqual(ran, ['c1']);
  assert.equal(keys.length, 3);
  assert.equal(keys[0], keys[1], 'resent under its key');
  assert.notEqual(keys[2], keys[0]);
  assert.deepEqual(
    result.unreported.map((u) => u.error.reason),
    ['SESSION_BUSY', 'SESSION_BUSY'],
  );
  assert.equal(run.checkpointVersion, 3);
});

test("a step's append that keeps failing throws with the request to resend", async () => {
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  const keys = [];
  const spy = (method, request, opts, real) => {
    if (method !== 'AppendItems') return real(method, request, opts);
    keys.push(request.idempotency_key);
    return Promise.reject(new UnavailableError(14, 'the engine went away'));
  };
  const { ran, opts } = fetchOnce();
  let failed;
  await withCall(spy, () =>
    run.toolLoop(opts).catch((error) => {
      failed = error;
    }),
  );
  assert.ok(failed instanceof UnavailableError, String(failed));
  assert.equal(keys.length, 3);
  assert.equal(new Set(keys).size, 1);
  assert.equal(failed.pendingRequest.idempotency_key, keys[0]);
  assert.deepEqual(
    failed.pendingRequest.items.map((item) => Object.keys(item).find((k) => k !== 'item_id')),
    ['tool_call', 'tool_result'],
  );
  await run.resendAppend(failed.pendingRequest);
  const result = await run.toolLoop(opts);
  assert.deepEqual(ran, ['c1'], 'the tool ran once');
  assert.equal(result.final.text, 'The 08:04.');
  assert.equal(run.checkpointVersion, 3);
});

test('every method takes a deadline of its own', async () => {
  const session = await engine.openSession(spec, { deadlineMs: 10_000 });
  const run = await session.startRun('Lyon?', { deadlineMs: 10_000 });
  for (const call of [
    () => run.build({ now: NOW, deadlineMs: 0.001 }),
    () => session.refreshPlan(0, { deadlineMs: 0.001 }),
    () => engine.call('ListControlTools', {}, { deadlineMs: 0.001 }),
  ]) {
    await assert.rejects(call(), (error) => {
      assert.ok(error instanceof DeadlineExceededError, error.name);
      return true;
    });
  }
  // Absent or 0: the client's deadline (30 s), not an expired one.
  assert.equal((await run.build({ now: NOW })).checkpointVersion, 1);
  assert.equal((await run.build({ now: NOW, deadlineMs: 0 })).checkpointVersion, 1);
});

test("a step's append that fails for good throws with the request, after one attempt", async () => {
  // The request was attached only when the resends ran out: an error never resent (an
  // expired token, a proxy's INTERNAL...) was thrown bare though the tools had run.
  for (const error of [
    new InvalidArgumentError(3, 'refused'),
    new AuthError(16, 'the token expired'),
    new InternalError(13, 'a proxy failed'),
    new ResourceExhaustedError(8, 'too large'),
    new ContextEngineError(1, 'cancelled'),
  ]) {
    const session = await engine.openSession(spec);
    const run = await session.startRun('Trains to Lyon?');
    const sent = [];
    const spy = (method, request, opts, real) => {
      if (method !== 'AppendItems') return real(method, request, opts);
      sent.push(request);
      return Promise.reject(error);
    };
    const { ran, opts } = fetchOnce();
    let failed;
    await withCall(spy, () =>
      run.toolLoop(opts).catch((thrown) => {
        failed = thrown;
      }),
    );
    assert.equal(failed, error, error.name);
    assert.equal(sent.length, 1, `${error.name} was resent`);
    assert.equal(failed.pendingRequest, sent[0], error.name);
    await run.resendAppend(failed.pendingRequest);
    const result = await run.toolLoop(opts);
    assert.deepEqual(ran, ['c1'], 'the tool ran once');
    assert.equal(result.final.text, 'The 08:04.');
  }
});

test("every wrapper sends its deadline; absent or 0, the client's", async () => {
  // The deadline test covered build, refreshPlan and call: a wrapper dropping `deadlineMs`
  // passed it. Here every RPC answers its empty response and records its deadline.
  const offline = new ContextEngineClient({ target: '127.0.0.1:1', tenantId: 't', timeoutMs: 12_500 });
  const seen = [];
  const service = protoPackage().context_engine.v1.ContextEngine.service;
  for (const [method, definition] of Object.entries(service)) {
    offline.raw[method] = (request, metadata, options, callback) => {
      seen.push([method, options.deadline.getTime() - Date.now()]);
      const empty = definition.responseDeserialize(Buffer.alloc(0));
      const plan = { epoch: 1, model_id: 'm' };
      callback(null, { ...empty, plan, run: { run_id: 'r', epoch: 1, parent_run_id: '' } });
    };
  }
  const usage = { inputTokens: 1 };
  const build = new BuildResult({ request_sequence: 1, request: null });
  const appendRequest = {
    tenant_id: 't',
    session_id: 's',
    run_id: 'r',
    expected_checkpoint_version: 1,
    idempotency_key: 'k',
    items: [],
  };
  const wrappers = {
    'ContextEngineClient.call': (e, s, r, o) => e.call('ListControlTools', {}, o),
    'ContextEngineClient.openSession': (e, s, r, o) => e.openSession(spec, o),
    'ContextEngineClient.session': (e, s, r, o) => e.session('s', 1, o),
    'ContextEngineClient.reportUsage': (e, s, r, o) =>
      e.reportUsage('s', 1, 'm', usage, undefined, o),
    'ContextEngineClient.getBuild': (e, s, r, o) => e.getBuild('s', 1, o),
    'ContextEngineClient.eraseSubject': (e, s, r, o) => e.eraseSubject('p', o),
    'ContextEngineClient.listControlTools': (e, s, r, o) => e.listControlTools(o),
    'Session.startRun': (e, s, r, o) => s.startRun('Hi', o),
    'Session.startChildRun': (e, s, r, o) => s.startChildRun('r', 'Go.', o),
    'Session.loadSkill': (e, s, r, o) => s.loadSkill('rail', 'Prefer TGV.', o),
    'Session.refreshPlan': (e, s, r, o) => s.refreshPlan(0, o),
    'Session.rotate': (e, s, r, o) => s.rotate('PLAN_REASON_AGENT_CHANGED', o),
    'Session.offerFactCandidates': (e, s, r, o) => s.offerFactCandidates(o),
    'Session.reportUsage': (e, s, r, o) => s.reportUsage(build, usage, undefined, o),
    'Run.append': (e, s, r, o) => r.append([assistantMessage('Hi.')], undefined, o),
    'Run.resendAppend': (e, s, r, o) => r.resendAppend(appendRequest, o),
    'Run.build': (e, s, r, o) => r.build(o),
    'Run.updateWorkingState': (e, s, r, o) => r.updateWorkingState({ objective: 'x' }, o),
    'Run.applyControlCall': (e, s, r, o) =>
      r.applyControlCall({ callId: 'c1', name: 'context.update_working_state', arguments: {} }, o),
    'Run.reportUsage': (e, s, r, o) => r.reportUsage(build, usage, undefined, o),
    'Run.compact': (e, s, r, o) => r.compact(async () => 'Summary.', o),
    'Run.toolLoop': (e, s, r, o) =>
      r.toolLoop({ ...o, callModel: answering('m'), runTool: async () => assert.fail('no tools') }),
  };
  // Every public method is either above or takes no deadline: a new one must be listed.
  const noDeadline = ['constructor', 'close', 'tenantId', 'run', 'start', 'ids', 'client'];
  const internal = ['appendRequest', 'appendStep', 'sendStep', 'buildStep', 'loop', 'report'];
  for (const cls of [ContextEngineClient, Session, Run]) {
    for (const name of Object.getOwnPropertyNames(cls.prototype)) {
      if ([...noDeadline, ...internal].includes(name)) continue;
      assert.ok(`${cls.name}.${name}` in wrappers, `${cls.name}.${name} is not tested`);
    }
  }
  try {
    for (const [name, wrapper] of Object.entries(wrappers)) {
      for (const [opts, expected] of [
        [{ deadlineMs: 7_000 }, 7_000],
        [{}, 12_500],
        [{ deadlineMs: 0 }, 12_500],
        [{ deadlineMs: undefined }, 12_500],
      ]) {
        seen.length = 0;
        const session = new Session(offline, 's', { epoch: 1, model_id: 'm' }, false, true);
        const run = new Run(session, 'r', 1, 1);
        await wrapper(offline, session, run, opts);
        assert.ok(seen.length > 0, `${name}: no RPC made`);
        for (const [method, left] of seen) {
          const where = `${name} (${method}) given ${JSON.stringify(opts)}: ${left} ms`;
          assert.ok(left <= expected && left > expected - 2_000, where);
        }
      }
    }
  } finally {
    offline.close();
  }
});

test("attaching at an older epoch keeps the current plan; a run's epoch follows its builds", async () => {
  // engine.session(id, 1) made epoch 1's plan the current one, so its next rotate failed
  // EPOCH_CONFLICT; Run.epoch was StartRun's forever.
  const session = await engine.openSession(spec);
  const run = await session.startRun('Trains to Lyon?');
  assert.equal(run.epoch, 1);
  await session.rotate('PLAN_REASON_AGENT_CHANGED');
  const attached = await engine.session(session.sessionId, 1);
  assert.deepEqual([attached.plan.epoch, attached.requestedPlan.epoch], [2, 1]);
  assert.equal((await attached.rotate('PLAN_REASON_BUILDER_UPGRADED')).epoch, 3);
  const built = await run.build({ now: NOW });
  assert.deepEqual([built.epoch, run.epoch], [3, 3]);
});

test('tool() leaves the side effect unspecified; a tool from a server is not built in', () => {
  const plain = tool('web.fetch', 'Fetch.', { type: 'object' });
  assert.deepEqual([plain.side_effect, plain.builtin, plain.server], ['SIDE_EFFECT_UNSPECIFIED', true, '']);
  const found = tool('mcp.fetch', 'Fetch.', { type: 'object' }, { server: 'mcp://tools' });
  assert.deepEqual([found.builtin, found.server], [false, 'mcp://tools']);
});

test('getBuild, eraseSubject and listControlTools have typed wrappers', async () => {
  const session = await engine.openSession(spec);
  const built = await (await session.startRun('Trains to Lyon?')).build({ now: NOW });
  const again = await engine.getBuild(session.sessionId, built.requestSequence);
  assert.ok(again.providerPayload.equals(built.providerPayload));
  assert.equal(again.requestSha256, built.requestSha256);
  const erased = await engine.eraseSubject(`nobody-${randomUUID()}`);
  assert.deepEqual([erased.bound_run_ids, erased.redacted_items], [[], 0]);
  const tools = await engine.listControlTools();
  assert.deepEqual(tools.map((t) => t.name), ['context.update_working_state']);
});

test("compact sends throughSequence and the summary's own token count", async () => {
  const reserve = 1024;
  const probe = await engine.openSession(spec);
  const session = await engine.openSession({
    ...spec,
    reserve_output_tokens: reserve,
    policy_cap_tokens: probe.plan.prefix_tokens + reserve + 4_000,
  });
  const first = await session.startRun('Tell me everything.');
  const [through] = (await first.append([assistantMessage(Array(6_000).fill('lorem').join(' '))]))
    .sequences;
  const run = await session.startRun('And now?');
  const sent = {};
  const spy = (method, request, opts, real) => {
    sent[method] = request;
    return real(method, request, opts);
  };
  const summary = { text: 'The assistant said a lot of lorem.', tokens: 9 };
  await withCall(spy, () => run.compact(async () => summary, { throughSequence: through }));
  assert.equal(sent.PrepareCompaction.through_sequence, through);
  assert.equal(sent.CommitCompaction.result.tokens_after, 9);
  assert.equal(sent.CommitCompaction.result.summary, summary.text);
});

test('toolResult cuts a source longer than the engine accepts', () => {
  // The engine refuses a source over 2,048 characters; a long signed URL would fail the step.
  const long = 'https://cdn.example/file?sig=' + 'x'.repeat(5000);
  const cut = toolResult('c1', 'web.fetch', 'page', { source: long }).tool_result.source;
  assert.equal(Array.from(cut).length, 2048);
  assert.ok(cut.endsWith('…'));
  assert.equal(toolResult('c1', 'web.fetch', 'page').tool_result.source, 'tool:web.fetch');
});

test('the tool loop sends a large output as its excerpt, and the run goes on', async () => {
  // A result the model is about to read never yields: one larger than the body failed every
  // Build of its run, and the loop could not give it its excerpt (a client audit).
  const probe = await engine.openSession(spec);
  const small = {
    ...spec,
    reserve_output_tokens: 1000,
    policy_cap_tokens: Number(probe.plan.prefix_tokens) + 1000 + 4000,
  };
  const session = await engine.openSession(small);
  const run = await session.startRun('Fetch the long page.');
  // The user message's sequence, to cite as a fact's evidence (the TypeScript Run lacked it).
  assert.ok(Number.isInteger(run.seedEventSequence) && run.seedEventSequence > 0);
  const page = Array(9000).fill('timetable').join(' ');
  const builds = [];
  const result = await run.toolLoop({
    now: NOW,
    callModel: async (build) => {
      builds.push(build);
      return builds.length === 1
        ? { toolCalls: [{ callId: 'c1', name: 'web-fetch', arguments: { url: 'u' } }] }
        : { text: 'It is long; the 08:04 TGV.' };
    },
    runTool: async () => ({
      content: page,
      artifactRef: 'pages/1',
      contextContent: page.slice(0, 2000),
    }),
  });
  assert.ok(result.final.text.startsWith('It is long'));
  const blocks = builds.at(-1).response.request.messages.flatMap((m) => m.blocks);
  const results = blocks.filter((b) => b.tool_result).map((b) => b.tool_result);
  assert.ok(results.length === 1 && results[0].content.length < 4000);
  assert.equal(
    toolResult('c1', 'web.fetch', page, { contextContent: 'head' }).tool_result.context_content,
    'head',
  );
});

for (const reason of ['SESSION_BUSY', 'EPOCH_CONFLICT']) {
  test(`a build refused ${reason} is built again and the loop goes on`, async () => {
    // Nothing was written: SESSION_BUSY is retryable, and after EPOCH_CONFLICT (an erasure
    // raced the Build) docs/api.md says build again. The loop ended on either (an audit).
    const session = await engine.openSession(spec);
    const run = await session.startRun('Home tonight?');
    const refused = new AbortedError(10, 'refused', reason);
    let builds = 0;
    engine.call = (method, request, opts) => {
      if (method === 'Build' && ++builds === 1) return Promise.reject(refused);
      return ContextEngineClient.prototype.call.call(engine, method, request, opts);
    };
    let result;
    try {
      result = await run.toolLoop({
        now: NOW,
        callModel: async () => ({ text: 'The 18:04.', usage: { inputTokens: 10, outputTokens: 2 } }),
        runTool: async () => assert.fail('no tools'),
      });
    } finally {
      delete engine.call;
    }
    assert.equal(result.final.text, 'The 18:04.');
    assert.equal(builds, 2);
    // Twice in a row, the refusal is the caller's.
    engine.call = (method, request, opts) =>
      method === 'Build'
        ? Promise.reject(refused)
        : ContextEngineClient.prototype.call.call(engine, method, request, opts);
    try {
      const again = await session.startRun('And back?');
      await assert.rejects(
        again.toolLoop({ now: NOW, callModel: async () => assert.fail('no build'), runTool: async () => {} }),
        (error) => error instanceof AbortedError && error.reason === reason,
      );
    } finally {
      delete engine.call;
    }
  });
}
