// A stock @grpc/grpc-js (Node) client publishing and receiving in batches on
// one Session, for tests/stock_clients.rs (docs/contract.md, "Batches").
//
// Usage: node grpcjs_batch.js ADDR PROTO_DIR COUNT
//
// The same run as grpcio_batch.py: a Session opened with the metadata
// `tinybroker-batch: 1`, handles 1 (`batch.>`) and 2 (`batch.even`); once
// both are opened, one SessionPublish (id 7) of COUNT messages (payload
// `<i>`, to batch.even for even i, batch.odd for odd i) and one (id 8) of a
// good message and a bad one (`batch.*`). Deliveries must come in
// `deliveries` events only; each handle gets its messages in order with the
// sequences the answers gave them. Then a half-close: both handles end
// "closed", the stream OK. Prints one line `result {json}`.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [addr, protoDir, countArg] = process.argv.slice(2);
const count = Number(countArg);

const definition = protoLoader.loadSync(path.join(protoDir, 'tinybroker/v1/broker.proto'), {
  includeDirs: [protoDir],
  keepCase: true,
  longs: Number,
  defaults: true,
  oneofs: true,
});
const { Broker } = grpc.loadPackageDefinition(definition).tinybroker.v1;
const client = new Broker(addr, grpc.credentials.createInsecure());

const result = {
  grpc_js: require('@grpc/grpc-js/package.json').version,
  problem: null,
  answers: [],
  deliveries_events: 0,
  bare_deliveries: 0,
  shared_deliveries: 0,
  received: { 1: 0, 2: 0 },
  ended: [],
  stream_code: null,
  stream_details: null,
};

function problem(text) {
  if (result.problem === null) result.problem = text;
}

const expected = { 1: [], 2: [] };
const received = { 1: [], 2: [] };
const opened = new Set();
let halfClosed = false;
let finished = false;

const metadata = new grpc.Metadata();
metadata.set('tinybroker-batch', '1');
const call = client.Session(metadata);
const watchdog = setTimeout(() => call.cancel(), 60000);

function finish() {
  if (finished) return;
  finished = true;
  clearTimeout(watchdog);
  for (const h of [1, 2]) {
    const got = received[h].map((r) => `${r[0]}@${r[1]}`);
    const want = expected[h].map((r) => `${r[0]}@${r[1]}`);
    if (got.join(',') !== want.join(',')) {
      let first = 0;
      while (first < got.length && got[first] === want[first]) first += 1;
      problem(`handle ${h}: ${got.length} received, ${want.length} expected; first difference at ${first}: ` +
        `${got.slice(first, first + 3)} against ${want.slice(first, first + 3)}`);
    }
  }
  console.log('result ' + JSON.stringify(result));
  client.close();
  process.exit(0);
}

function publish(id, messages) {
  call.write({
    publish: { id, messages: messages.map(([topic, payload]) => ({ topic, payload: Buffer.from(payload) })) },
  });
}

function maybeHalfClose() {
  const done = result.answers.length === 2 && [1, 2].every((h) => received[h].length === expected[h].length);
  if (done && !halfClosed) {
    halfClosed = true;
    call.end();
  }
}

for (const [handle, pattern] of [[1, 'batch.>'], [2, 'batch.even']]) {
  call.write({ open: { handle, subscription: { topic_patterns: [pattern] } } });
}

call.on('data', (event) => {
  switch (event.event) {
    case 'opened':
      opened.add(event.opened.handle);
      if (opened.size === 2) {
        const messages = [];
        for (let i = 0; i < count; i += 1) messages.push([i % 2 === 0 ? 'batch.even' : 'batch.odd', String(i)]);
        publish(7, messages);
        publish(8, [['batch.even', 'good'], ['batch.*', 'bad']]);
      }
      break;
    case 'published': {
      const p = event.published;
      result.answers.push({
        id: p.id,
        accepted: p.accepted,
        first_sequence: p.first_sequence,
        rejected: p.rejected.map((r) => ({ index: r.index, code: r.code, message: r.message })),
      });
      if (p.id === 7) {
        for (let i = 0; i < p.accepted; i += 1) {
          expected[1].push([String(i), p.first_sequence + i]);
          if (i % 2 === 0) expected[2].push([String(i), p.first_sequence + i]);
        }
      } else if (p.id === 8 && p.accepted === 1) {
        expected[1].push(['good', p.first_sequence]);
        expected[2].push(['good', p.first_sequence]);
      }
      maybeHalfClose();
      break;
    }
    case 'deliveries':
      result.deliveries_events += 1;
      for (const d of event.deliveries.deliveries) {
        if (d.handles.length > 1) result.shared_deliveries += 1;
        if (new Set(d.handles).size !== d.handles.length) problem(`a delivery names a handle twice: ${d.handles}`);
        for (const h of d.handles) {
          if (!received[h]) {
            problem(`a delivery for unknown handle ${h}`);
            continue;
          }
          received[h].push([d.message.payload.toString(), d.message.sequence]);
          result.received[h] = received[h].length;
        }
      }
      maybeHalfClose();
      break;
    case 'delivery':
      result.bare_deliveries += 1;
      break;
    case 'ended':
      result.ended.push({ handle: event.ended.handle, reason: event.ended.reason });
      break;
    default:
      problem(`an event of unknown kind ${event.event}`);
  }
});
call.on('error', (error) => {
  result.stream_code = grpc.status[error.code];
  result.stream_details = error.details;
  finish();
});
call.on('end', () => {
  if (result.stream_code === null) result.stream_code = 'OK';
});
call.on('status', (status) => {
  if (status.code === grpc.status.OK) {
    result.stream_code = 'OK';
    finish();
  }
});
