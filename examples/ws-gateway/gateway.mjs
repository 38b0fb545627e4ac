// A WebSocket fan-out gateway on tinybroker: each browser that connects to
// ws://HOST:PORT/?user=ID gets its own subscription (`user.ID.>` and the
// `broadcast.>` topics), and every message on it is sent down its
// WebSocket as JSON. All those subscriptions ride on the gateway's one
// client: one HTTP/2 connection, one Session stream, each subscription with
// its own credit window, so one slow browser stalls only its own.
//
//     TINYBROKER_ADDR=127.0.0.1:50051 PORT=8080 node gateway.mjs
//
// then, in a browser console: new WebSocket("ws://localhost:8080/?user=42")
// .onmessage = (e) => console.log(e.data), and publish with
// `tinybroker publish user.42.greeting hello`.
import { createServer } from "node:http";
import { pathToFileURL } from "node:url";
import { connect } from "@tinybroker/client";
import { WebSocketServer } from "ws";

/** Past this many bytes queued on a WebSocket, the gateway stops taking messages for it until they are sent. */
const HIGH_WATER = 256 * 1024;

/**
 * Starts the gateway on `port` (0: any free port), connected to the broker at
 * `brokerAddr` (default TINYBROKER_ADDR). Resolves to { port, client, close }.
 */
export async function startGateway({ port = 0, host = "127.0.0.1", brokerAddr } = {}) {
  const client = await connect(brokerAddr);
  const http = createServer((_req, res) => {
    res.writeHead(426, { "content-type": "text/plain" }).end("connect with a WebSocket: /?user=ID\n");
  });
  const wss = new WebSocketServer({ server: http });
  wss.on("connection", (ws, req) => {
    const user = new URL(req.url ?? "/", "http://x").searchParams.get("user") ?? "";
    if (!/^[A-Za-z0-9_-]{1,64}$/.test(user)) {
      ws.close(1008, "?user=ID (letters, digits, _ and -)");
      return;
    }
    void serve(client, ws, user);
  });
  await new Promise((resolve) => http.listen(port, host, resolve));
  return {
    port: http.address().port,
    client,
    async close() {
      for (const ws of wss.clients) ws.terminate();
      await new Promise((resolve) => wss.close(resolve));
      await new Promise((resolve) => http.close(resolve));
      await client.close();
    },
  };
}

/** One browser: one subscription, pumped into its WebSocket until either side ends. */
async function serve(client, ws, user) {
  const closed = new AbortController();
  ws.on("close", () => closed.abort());
  let sub;
  try {
    // Aborting the signal (the browser went away) closes the subscription.
    sub = await client.subscribe([`user.${user}.>`, "broadcast.>"], { signal: closed.signal });
  } catch (e) {
    if (!closed.signal.aborted) ws.close(1011, String(e.message).slice(0, 120));
    return;
  }
  send(ws, { type: "ready", subscriptionId: sub.subscriptionId });
  try {
    for await (const msg of sub) {
      send(ws, { type: "message", topic: msg.topic, sequence: msg.sequence, payload: msg.string() });
      // Backpressure: a browser that does not keep up stops being read for,
      // which stalls its subscription alone (the broker keeps its messages
      // in its own queue and evicts it if that queue fills).
      while (ws.bufferedAmount > HIGH_WATER && ws.readyState === ws.OPEN) {
        await new Promise((r) => setTimeout(r, 10));
      }
      if (ws.readyState !== ws.OPEN) break;
    }
  } catch (e) {
    // Ended for good (an admin closed it): tell the browser.
    if (ws.readyState === ws.OPEN) ws.close(1011, String(e.message).slice(0, 120));
  } finally {
    await sub.close();
  }
}

function send(ws, value) {
  if (ws.readyState === ws.OPEN) ws.send(JSON.stringify(value));
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
  const gw = await startGateway({ port: Number(process.env.PORT ?? 8080), host: process.env.HOST ?? "0.0.0.0" });
  console.log(`ws-gateway listening on :${gw.port}, broker ${gw.client.address}`);
  const stop = async () => {
    await gw.close();
    process.exit(0);
  };
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
}
