// An example agent worker: one session, one turn, a tool loop against a real provider API.
//
//   npm run build
//   CONTEXT_ENGINE_TARGET=127.0.0.1:50051 ANTHROPIC_API_KEY=... \
//     node dist/examples/worker.js "Trains from Paris to Lyon tomorrow?"
//
// The engine never calls a model: the worker does, by POSTing `build.providerPayload`
// as-is to the API named by `build.providerApi` (its messages have no attachments, which
// a worker would add where `build.attachmentPlacements` says: docs/api.md). To try it
// without a provider account,
// run the caching fake provider (`context-engine fake-provider --listen 127.0.0.1:8089`)
// and set ANTHROPIC_BASE_URL=http://127.0.0.1:8089 ANTHROPIC_API_KEY=test (for OpenAI:
// OPENAI_BASE_URL=http://127.0.0.1:8089/v1 OPENAI_API_KEY=test MODEL_ID=<an OpenAI model>).
// The base URLs follow the providers' SDKs: Anthropic's without /v1, OpenAI's with it.
//
// When a run's history outgrows the request body, Build answers needs_compaction and the
// tool loop compacts: PrepareCompaction, then `summarize` below (a model call of the
// worker's own, outside the engine's requests), then CommitCompaction, then Build again.
// POLICY_CAP_TOKENS=<tokens> caps the request (prefix, body and the 1,024 reserved for the
// answer) to see that on a short session.

import {
  type BuildResult,
  ContextEngineClient,
  ContextEngineError,
  type ModelTurn,
  type PlanSpec,
  type PrepareCompactionResponse,
  type ToolCallRequest,
  type ToolOutput,
  tool,
  usageFromAnthropic,
  usageFromOpenAI,
} from '../src/index.js';

const env = process.env;
const target = env.CONTEXT_ENGINE_TARGET ?? '127.0.0.1:50051';
const tenantId = env.CONTEXT_ENGINE_TENANT ?? 'example';

const spec: PlanSpec = {
  model_id: env.MODEL_ID ?? 'claude-sonnet-4-5',
  agent: {
    agent_id: 'trips',
    version: '1',
    instructions: 'You help people plan train trips. Use web.fetch to read timetables.',
  },
  principal: { principal_id: 'ada', scopes: ['web.read'], scope_label: 'Ada (owner)' },
  tools: [
    tool(
      'web.fetch',
      'Fetch a web page and return its text.',
      { type: 'object', properties: { url: { type: 'string' } }, required: ['url'] },
      { requiredScopes: ['web.read'], sideEffect: 'SIDE_EFFECT_NETWORK_READ' },
    ),
  ],
  environment: { surface: 'chat', time_zone: 'Europe/Paris' },
  // A small cap shows compaction on a short session; the answer then has 1,024 tokens. By
  // default the model's window and its own output reserve apply.
  ...(env.POLICY_CAP_TOKENS
    ? { policy_cap_tokens: Number(env.POLICY_CAP_TOKENS), reserve_output_tokens: 1024 }
    : {}),
};

// Each provider API: where to POST the payload, how to authenticate, how to read the reply.
const PROVIDERS: Record<
  string,
  { url: string; headers: Record<string, string>; parse: (body: any) => ModelTurn }
> = {
  'anthropic.messages': {
    url: `${env.ANTHROPIC_BASE_URL ?? 'https://api.anthropic.com'}/v1/messages`,
    headers: { 'x-api-key': env.ANTHROPIC_API_KEY ?? '', 'anthropic-version': '2023-06-01' },
    parse: (body) => ({
      text: body.content
        .filter((b: any) => b.type === 'text')
        .map((b: any) => b.text)
        .join(''),
      toolCalls: body.content
        .filter((b: any) => b.type === 'tool_use')
        .map((b: any) => ({ callId: b.id, name: b.name, arguments: b.input })),
      reasoning: body.content
        .filter((b: any) => b.type === 'thinking' || b.type === 'redacted_thinking')
        .map((b: any) => ({
          provider: 'PROVIDER_ANTHROPIC' as const,
          opaque: Buffer.from(JSON.stringify(b)),
        })),
      usage: usageFromAnthropic(body.usage ?? {}),
      model: body.model, // the model that answered: usage is reported under it
    }),
  },
  'openai.responses': {
    url: `${env.OPENAI_BASE_URL ?? 'https://api.openai.com/v1'}/responses`,
    headers: { authorization: `Bearer ${env.OPENAI_API_KEY ?? ''}` },
    parse: (body) => {
      const messages = body.output.filter((o: any) => o.type === 'message');
      return {
        text: messages.flatMap((o: any) => o.content.map((c: any) => c.text ?? '')).join(''),
        // The output items' ids pair them with the turn's reasoning on replay: the text's
        // when it came in one message (joined from several, it is no one item's).
        textItemId: messages.length === 1 ? messages[0].id : '',
        toolCalls: body.output
          .filter((o: any) => o.type === 'function_call')
          .map((o: any) => ({
            callId: o.call_id,
            name: o.name,
            arguments: o.arguments,
            providerItemId: o.id,
          })),
        reasoning: body.output
          .filter((o: any) => o.type === 'reasoning')
          .map((o: any) => ({
            provider: 'PROVIDER_OPENAI' as const,
            opaque: Buffer.from(JSON.stringify(o)),
          })),
        usage: usageFromOpenAI(body.usage ?? {}),
        model: body.model,
      };
    },
  },
};

// The provider API the session's builds go to (from its plan): its summaries go there too.
let providerApi = '';
const PROVIDER_APIS: Record<string, string> = {
  PROVIDER_ANTHROPIC: 'anthropic.messages',
  PROVIDER_OPENAI: 'openai.responses',
};

async function post(apiName: string, body: Uint8Array<ArrayBuffer> | string): Promise<ModelTurn> {
  const api = PROVIDERS[apiName];
  if (!api) throw new Error(`no provider API ${JSON.stringify(apiName)}`);
  const response = await fetch(api.url, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...api.headers },
    body,
  });
  if (!response.ok) throw new Error(`${api.url}: HTTP ${response.status}`);
  return api.parse(await response.json());
}

async function callModel(build: BuildResult): Promise<ModelTurn> {
  if (!PROVIDERS[build.providerApi] || build.providerPayload.length === 0) {
    throw new Error(`no provider payload for ${JSON.stringify(build.providerApi)}`);
  }
  providerApi = build.providerApi;
  console.log(
    `build #${build.requestSequence}: prefix ${build.prefixSha256.slice(0, 16)}… ` +
      `request ${build.requestSha256.slice(0, 12)}… (${build.providerApi})`,
  );
  return post(build.providerApi, new Uint8Array(build.providerPayload)); // as built, unchanged
}

// The summarizer: the engine's prompt as the instructions, what it prepared as the input.
// Untrusted spans arrive elided to pointers; the engine refuses a summary that repeats
// elided text, so the model is told to keep the pointers and nothing else of them.
async function summarize(prepared: PrepareCompactionResponse): Promise<string> {
  console.log(`compacting through event ${prepared.replaced_through_sequence}`);
  const model = spec.model_id;
  const request =
    providerApi === 'openai.responses'
      ? { model, instructions: prepared.prompt, input: prepared.summarizer_input }
      : {
          model,
          max_tokens: 1024,
          system: prepared.prompt,
          messages: [{ role: 'user', content: prepared.summarizer_input }],
        };
  const turn = await post(providerApi, JSON.stringify(request));
  return turn.text ?? '';
}

// A toy tool: a real worker dispatches to its tool registry and policy engine here.
async function runTool(call: ToolCallRequest): Promise<ToolOutput> {
  console.log(`tool ${call.name} ${JSON.stringify(call.arguments)}`);
  if (call.name !== 'web.fetch') {
    // Untrusted, the default: the name is whatever the model emitted.
    return { content: `unknown tool ${call.name}`, isError: true };
  }
  return { content: '08:04 TGV 6601 Paris Gare de Lyon -> Lyon Part-Dieu 10:00', source: 'tool:web.fetch' };
}

async function main(): Promise<void> {
  const question = process.argv[2] ?? 'Trains from Paris to Lyon tomorrow?';
  const engine = new ContextEngineClient({ target, tenantId, token: env.CONTEXT_ENGINE_TOKEN });
  try {
    const session = await engine.openSession(spec);
    providerApi = PROVIDER_APIS[String(session.plan.provider)] ?? '';
    console.log(`session ${session.sessionId}: epoch ${session.plan.epoch}, prefix ${session.plan.prefix_tokens} tokens`);
    const run = await session.startRun(question);
    const result = await run.toolLoop({ callModel, runTool, summarize, now: () => new Date() });
    console.log(`answer: ${result.final.text}`);
    console.log(`distinct prefix hashes: ${new Set(result.builds.map((b) => b.prefixSha256)).size}`);
    // toolLoop keeps a failed usage report rather than lose the answer to it. Resend the
    // retryable ones: the key is the build's, so one that landed with its answer lost
    // counts once. The others would fail again: say so, or the usage is lost unseen.
    for (const u of result.unreported) {
      let error = u.error;
      if (error instanceof ContextEngineError && error.retryable) {
        try {
          await session.reportUsage(u.build, u.usage, undefined, { model: u.model });
          continue;
        } catch (resendError) {
          error = resendError;
        }
      }
      console.error(`usage of request #${u.build.requestSequence} not reported: ${String(error)}`);
    }
  } finally {
    engine.close();
  }
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
