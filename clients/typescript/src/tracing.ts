// W3C trace context through message headers, where the OpenTelemetry API
// (`@opentelemetry/api`, an optional peer dependency) is installed: publish
// adds the active context's `traceparent`/`tracestate` (through the global
// propagator the OpenTelemetry SDK registers), and a delivered message gives
// back the context its headers carry. Without the API nothing happens.

/** The part of `@opentelemetry/api` used here. */
interface OtelApi {
  context: { active(): unknown };
  propagation: {
    inject(context: unknown, carrier: Record<string, string>): void;
    extract(context: unknown, carrier: Record<string, string>): unknown;
  };
  ROOT_CONTEXT: unknown;
}

let api: OtelApi | null | undefined;

/** @internal Loads the OpenTelemetry API once, if it is installed. */
export async function loadTracing(): Promise<boolean> {
  if (api === undefined) {
    try {
      const name = "@opentelemetry/api";
      api = (await import(name)) as OtelApi;
    } catch {
      api = null;
    }
  }
  return api !== null;
}

/** @internal `headers` plus the active context's trace headers (a header the caller set is kept). */
export function inject(headers: Record<string, string> | undefined): Record<string, string> {
  if (!api) return headers ?? {};
  const carrier: Record<string, string> = {};
  api.propagation.inject(api.context.active(), carrier);
  let merged: Record<string, string> | undefined;
  for (const key in carrier) {
    if (headers !== undefined && key in headers) continue;
    merged ??= { ...headers };
    merged[key] = carrier[key]!;
  }
  return merged ?? headers ?? {};
}

/** @internal The context carried by `headers` (undefined without the API). */
export function extract(headers: Record<string, string>): unknown {
  return api ? api.propagation.extract(api.ROOT_CONTEXT, headers) : undefined;
}
