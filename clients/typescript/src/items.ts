// Small constructors for the messages a worker writes most, and the tool-loop value types.
// They return plain proto-loader objects, so they mix freely with hand-written ones.

import type { ConversationItem, ToolSpec, TrustLevel, SideEffect } from './types.js';

type Json = Record<string, unknown>;

const asJson = (value: Json | string): string =>
  typeof value === 'string' ? value : JSON.stringify(value);

export function userMessage(text: string, itemId = ''): ConversationItem {
  return { item_id: itemId, user_message: { text } };
}

/**
 * The model's text. `providerItemId`: OpenAI's id of the output message (`msg_...`), which
 * pairs it with the turn's reasoning when the engine replays that.
 */
export function assistantMessage(text: string, itemId = '', providerItemId = ''): ConversationItem {
  return { item_id: itemId, assistant_message: { text, provider_item_id: providerItemId } };
}

/**
 * The model's tool call. `providerItemId`: OpenAI's id of the `function_call` output item
 * (`fc_...`, not its call id), which pairs it with the turn's reasoning on replay.
 */
export function toolCall(
  callId: string,
  name: string,
  args: Json | string,
  opts: { taskId?: string; itemId?: string; providerItemId?: string } = {},
): ConversationItem {
  return {
    item_id: opts.itemId ?? '',
    tool_call: {
      call_id: callId,
      tool_name: name,
      arguments_json: asJson(args),
      task_id: opts.taskId ?? '',
      provider_item_id: opts.providerItemId ?? '',
    },
  };
}

export interface ToolResultOptions {
  /** Defaults to TRUST_LEVEL_EXTERNAL_UNTRUSTED: say so when the content deserves more. */
  trust?: TrustLevel;
  source?: string;
  isError?: boolean;
  artifactRef?: string;
  /**
   * The excerpt the request sends in place of `content` (marked truncated); the log keeps
   * `content` whole. A large output needs one: a result the model is about to read never
   * yields, and one larger than the request's body fails every Build of its run.
   */
  contextContent?: string;
  itemId?: string;
}

/** The engine refuses a result's source longer than this (INVALID_FIELD); toolResult cuts a
 * longer one (a signed URL, say) rather than fail the step. */
export const MAX_SOURCE_CHARS = 2048;

function attribution(source: string): string {
  // Code points, as the engine counts characters (a surrogate pair is one).
  const chars = Array.from(source);
  return chars.length > MAX_SOURCE_CHARS
    ? chars.slice(0, MAX_SOURCE_CHARS - 1).join('') + '…'
    : source;
}

// Half a surrogate pair: what `.slice()` leaves when it cuts an emoji in two (an output cut
// to an excerpt, say), or JSON.parse of an escaped half ("\ud83d", from an API that cut
// one in UTF-16). protobufjs encodes it as invalid UTF-8, and the engine refuses the whole
// request as undecodable, naming no field (a review); TextEncoder sends U+FFFD for it, and
// so do toolResult and the Python client.
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g;

// U+0000 too, which the engine cannot store: an output holding one failed the whole step
// after its tools had run (a review).
function wellFormed(text: string): string {
  return text.replace(LONE_SURROGATE, '\uFFFD').replaceAll('\0', '\uFFFD');
}

// What the engine logs of a call's arguments (its canonical JSON, RFC 8785): an object, at
// most 64 levels deep, whose numbers read back exactly and whose strings hold no U+0000
// and no half of a surrogate pair.
const MAX_DEPTH = 64;

const UNSAFE_INTEGER = 'hold an integer beyond 2^53 - 1 (send large ids as strings)';
const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);
const DIGIT = /[0-9]/;
const NUMBER_CHAR = /[0-9.eE+-]/;

/**
 * Whether JSON text holds an integer literal (no fraction, no exponent) past 2^53 - 1 in
 * magnitude, outside its strings. The engine reads such a literal exactly and refuses it;
 * JSON.parse rounds it to a double, and one of 22 digits or more (a 24-digit order id)
 * came out at 1e21 or above, which the engine takes as a double: the check passed, the
 * tool ran, and then every append of its step was refused (an audit). `text` is JSON.
 */
function hasUnsafeIntegerLiteral(text: string): boolean {
  let i = 0;
  while (i < text.length) {
    if (text[i] === '"') {
      i += 1;
      while (i < text.length && text[i] !== '"') i += text[i] === '\\' ? 2 : 1; // \" is two
      i += 1;
    } else if (text[i] === '-' || DIGIT.test(text[i])) {
      const start = i;
      while (i < text.length && NUMBER_CHAR.test(text[i])) i += 1;
      const literal = text.slice(start, i);
      // 16 digits at least (2^53 - 1 has 16); a fraction or an exponent makes a double.
      if (literal.length >= 16 && !/[.eE]/.test(literal)) {
        const integer = BigInt(literal);
        if (integer > MAX_SAFE || -integer > MAX_SAFE) return true;
      }
    } else {
      i += 1;
    }
  }
  return false;
}

/**
 * Why the engine would refuse to log a call with these arguments (AppendItems'
 * INVALID_FIELD naming arguments_json), or '' when it would take them: a model's cut-off
 * or non-object arguments, an integer past 2^53 such as a 64-bit id. None ('') is taken,
 * as the engine reads it as {}. The tool loop checks before it runs a tool, as a step it
 * cannot log would be run again (a review).
 */
export function argumentsProblem(args: Json | string): string {
  let value: unknown;
  let text: string;
  try {
    text = asJson(args);
  } catch (error) {
    return `are not JSON-serializable (${(error as Error).message})`; // a BigInt, a cycle
  }
  if (text === '') return ''; // the engine reads no arguments as {} (a tool without parameters)
  try {
    value = JSON.parse(text);
  } catch (error) {
    return `are not JSON (${(error as Error).message})`;
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    return 'are not a JSON object';
  }
  if (hasUnsafeIntegerLiteral(text)) return UNSAFE_INTEGER;
  const stack: [unknown, number][] = [[value, 1]];
  while (stack.length) {
    const [node, depth] = stack.pop()!;
    if (depth > MAX_DEPTH) return `nest deeper than ${MAX_DEPTH} levels`;
    if (typeof node === 'string') {
      if (node.includes('\0')) return 'hold U+0000';
      if (new RegExp(LONE_SURROGATE.source).test(node)) return 'hold half a surrogate pair';
    } else if (typeof node === 'number') {
      // As the engine reads numbers (core/canonical.py): a double past 2^53 - 1 and below
      // 1e21 is written as an integer no parser reads back exactly; 1e400 is an infinity.
      // A double of 1e21 or more is taken, unless it was written as an integer literal
      // (hasUnsafeIntegerLiteral).
      const size = Math.abs(node);
      if (!Number.isFinite(node)) return 'hold a number JSON cannot carry exactly';
      if (size > Number.MAX_SAFE_INTEGER && size < 1e21) return UNSAFE_INTEGER;
    } else if (Array.isArray(node)) {
      for (const child of node) stack.push([child, depth + 1]);
    } else if (typeof node === 'object' && node !== null) {
      for (const [key, child] of Object.entries(node)) {
        stack.push([key, depth], [child, depth + 1]);
      }
    }
  }
  return '';
}

/** The longest id the engine takes (a call id, a provider's item id), in code points. */
export const MAX_ID_CHARS = 200;
// What a provider's item id may not hold (the engine's _provider_item_id): whitespace, as
// Python's str.isspace() finds it, or a control character (U+0000-U+001F, U+007F-U+009F,
// U+2028, U+2029). Together, this class, code point for code point (JavaScript's \s is
// another set: U+FEFF in, U+001C-U+001F and U+0085 out).
const NOT_IN_AN_ID = /[\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]/;

/**
 * Why the engine would refuse `value` as a provider's item id (AppendItems' INVALID_FIELD
 * naming provider_item_id), or '' when it would take it.
 */
export function itemIdProblem(value: string): string {
  if (Array.from(value).length > MAX_ID_CHARS) return `is longer than ${MAX_ID_CHARS} characters`;
  if (NOT_IN_AN_ID.test(value)) return 'holds whitespace or a control character';
  return '';
}

// What the engine replays of a provider's reasoning (core/items.py): per provider, the
// "type"s it takes; per type, the keys it must hold (with their JSON types) and may hold.
const REASONING_TYPES: Record<string, readonly string[]> = {
  PROVIDER_ANTHROPIC: ['redacted_thinking', 'thinking'],
  PROVIDER_OPENAI: ['reasoning'],
};
const PROVIDER_NAMES: Record<number, string> = { 1: 'PROVIDER_ANTHROPIC', 2: 'PROVIDER_OPENAI' };
const REASONING_FIELDS: Record<string, Record<string, 'string' | 'array'>> = {
  thinking: { thinking: 'string', signature: 'string' },
  redacted_thinking: { data: 'string' },
  reasoning: { id: 'string', summary: 'array' },
};
const REASONING_KEYS: Record<string, readonly string[]> = {
  thinking: ['type', 'thinking', 'signature'],
  redacted_thinking: ['type', 'data'],
  reasoning: ['type', 'id', 'summary', 'content', 'encrypted_content', 'status'],
};

/**
 * Why the engine would refuse to log a reasoning item (AppendItems' INVALID_FIELD naming
 * its provider or opaque), or '' when it would take it.
 */
export function reasoningProblem(provider: unknown, opaque: Uint8Array): string {
  const name = typeof provider === 'number' ? PROVIDER_NAMES[provider] : provider;
  const types = typeof name === 'string' && Object.hasOwn(REASONING_TYPES, name)
    ? REASONING_TYPES[name]
    : undefined;
  if (!types) return 'names no provider (PROVIDER_ANTHROPIC or PROVIDER_OPENAI)';
  if (!opaque?.length) return 'is empty';
  let text: string;
  try {
    // A BOM is kept, as Python's decode keeps it (and JSON then refuses it).
    text = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(opaque);
  } catch {
    return 'is not UTF-8';
  }
  const problem = argumentsProblem(text); // the engine parses it as it parses arguments
  if (problem) return `is no JSON object the engine can store: its bytes ${problem}`;
  const payload = JSON.parse(text) as Record<string, unknown>;
  const kind = Object.hasOwn(payload, 'type') ? payload.type : undefined;
  if (typeof kind !== 'string' || !types.includes(kind)) {
    return `has a "type" other than ${types.map((t) => `'${t}'`).join(' or ')}`;
  }
  for (const [key, jsonType] of Object.entries(REASONING_FIELDS[kind])) {
    const value = Object.hasOwn(payload, key) ? payload[key] : undefined;
    if (jsonType === 'string' ? typeof value !== 'string' : !Array.isArray(value)) {
      return `is a '${kind}' item without "${key}"`;
    }
  }
  const unknown = Object.keys(payload)
    .filter((key) => !REASONING_KEYS[kind].includes(key))
    .sort();
  if (unknown.length) {
    return `is a '${kind}' item holding '${unknown[0]}', which the provider's type lacks`;
  }
  return '';
}

export function toolResult(
  callId: string,
  name: string,
  content: string,
  opts: ToolResultOptions = {},
): ConversationItem {
  return {
    item_id: opts.itemId ?? '',
    tool_result: {
      call_id: callId,
      tool_name: name,
      content: wellFormed(content),
      trust: opts.trust ?? 'TRUST_LEVEL_EXTERNAL_UNTRUSTED',
      // An empty source too, as in Python; an empty name takes its call's on the server,
      // which then names the source by it.
      source: wellFormed(attribution(opts.source || (name ? `tool:${name}` : ''))),
      is_error: opts.isError ?? false,
      artifact_ref: opts.artifactRef ?? '',
      context_content: wellFormed(opts.contextContent ?? ''),
    },
  };
}

export interface ToolOptions {
  requiredScopes?: string[];
  /**
   * What the tool does to the world; say it. Unspecified (the default), the engine treats
   * the tool as the most consequential kind.
   */
  sideEffect?: SideEffect;
  /** The MCP server or device that provides a discovered tool; empty for a built-in. */
  server?: string;
  /**
   * Defaults to `!server`: a tool some server provides is a discovered one, whose
   * description the engine does not trust.
   */
  builtin?: boolean;
}

/** A tool for a PlanSpec's candidate list. */
export function tool(
  name: string,
  description: string,
  inputSchema: Json | string,
  opts: ToolOptions = {},
): ToolSpec {
  return {
    name,
    description,
    input_schema_json: asJson(inputSchema),
    required_scopes: opts.requiredScopes ?? [],
    side_effect: opts.sideEffect ?? 'SIDE_EFFECT_UNSPECIFIED',
    builtin: opts.builtin ?? !opts.server,
    server: opts.server ?? '',
  };
}

/** A model response's token usage, as ReportUsage wants it (input = uncached input). */
export interface Usage {
  inputTokens: number;
  outputTokens?: number;
  cacheReadInputTokens?: number;
  cacheCreationInputTokens?: number;
}

/**
 * From an Anthropic Messages response's `usage` object: the SDK's `Usage` type is taken as
 * it is (its counts nullable; an index signature would refuse an interface without one).
 */
export function usageFromAnthropic(usage: {
  input_tokens?: number | null;
  output_tokens?: number | null;
  cache_read_input_tokens?: number | null;
  cache_creation_input_tokens?: number | null;
}): Usage {
  return {
    inputTokens: usage.input_tokens ?? 0,
    outputTokens: usage.output_tokens ?? 0,
    cacheReadInputTokens: usage.cache_read_input_tokens ?? 0,
    cacheCreationInputTokens: usage.cache_creation_input_tokens ?? 0,
  };
}

/** From an OpenAI Responses response's `usage` object. */
export function usageFromOpenAI(usage: {
  input_tokens?: number | null;
  output_tokens?: number | null;
  input_tokens_details?: { cached_tokens?: number | null } | null;
}): Usage {
  const cached = usage.input_tokens_details?.cached_tokens ?? 0;
  return {
    inputTokens: (usage.input_tokens ?? 0) - cached,
    outputTokens: usage.output_tokens ?? 0,
    cacheReadInputTokens: cached,
  };
}

/** A tool call the model asked for. */
export interface ToolCallRequest {
  callId: string;
  name: string;
  arguments: Json | string;
  taskId?: string;
  /** OpenAI's id of the function_call output item (`fc_...`): see toolCall. */
  providerItemId?: string;
}

/** What a tool returned, with the trust its content deserves. */
export interface ToolOutput {
  content: string;
  trust?: TrustLevel;
  isError?: boolean;
  source?: string;
  artifactRef?: string;
  /** The excerpt the request sends in place of `content` (toolResult's contextContent). */
  contextContent?: string;
}

/** One model response reduced to what the engine logs. No tool calls ends the loop. */
export interface ModelTurn {
  text?: string;
  toolCalls?: ToolCallRequest[];
  /**
   * Provider-opaque reasoning items (JSON bytes), replayed verbatim within the run. From
   * OpenAI, give `textItemId` and each call's `providerItemId` too: the API pairs a replayed
   * reasoning item with the item after it by that id, and the engine replays no reasoning
   * whose following item has none. turnItems orders a turn as reasoning, text, then calls,
   * which pairs one reasoning item with its output: log a response that interleaves
   * several reasoning items with its outputs item by item, in its own order.
   */
  reasoning?: { provider: 'PROVIDER_ANTHROPIC' | 'PROVIDER_OPENAI'; opaque: Uint8Array }[];
  /** OpenAI's id of the output message (`msg_...`) the text came in. */
  textItemId?: string;
  usage?: Usage;
  /**
   * The model that answered: the provider response's `model` (absent: the request's own).
   * Usage is reported under it, since the engine learns only from reports of the model the
   * request was built for (a dated snapshot of it counts as it).
   */
  model?: string;
}

/** The turn as conversation items: reasoning, text, then tool calls. */
export function turnItems(turn: ModelTurn): ConversationItem[] {
  const items: ConversationItem[] = (turn.reasoning ?? []).map((r) => ({
    reasoning: { provider: r.provider, opaque: Buffer.from(r.opaque) },
  }));
  // U+0000 (and half a surrogate pair), which the engine cannot take, as U+FFFD: the
  // step's append failed after its tools ran (a review).
  if (turn.text) items.push(assistantMessage(wellFormed(turn.text), '', turn.textItemId ?? ''));
  for (const call of turn.toolCalls ?? []) {
    items.push(
      toolCall(call.callId, call.name, call.arguments, {
        taskId: call.taskId,
        providerItemId: call.providerItemId,
      }),
    );
  }
  return items;
}
