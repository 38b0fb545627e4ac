// A stock @grpc/grpc-js (Node) client for tests/stock_clients.rs.
//
// Usage: node grpcjs_publish.js ADDR PROTO_DIR COUNT PAYLOAD_BYTES PAUSE_AT SUBSCRIBE
//
// Publishes COUNT messages of PAYLOAD_BYTES through one PublishStream, writing
// the way a Node program does (call.write until it returns false, then wait
// for 'drain'). With SUBSCRIBE=1 it first opens a broadcast subscription on
// the same client (the same channel and connection) and checks that it gets
// every message in order. It prints `subscribed`, `pause` once PAUSE_AT
// messages have been written (the test then SIGSTOPs the broker for a while),
// and at the end one line `result {json}`. GRPC_JS_CHANNEL_OPTIONS (JSON) are
// channel options, e.g. {"grpc.per_rpc_retry_buffer_size": 65536}.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [addr, protoDir, countArg, payloadArg, pauseArg, subscribeArg] = process.argv.slice(2);
const count = Number(countArg);
const payloadBytes = Number(payloadArg);
const pauseAt = Number(pauseArg);
const subscribe = subscribeArg === '1';

const definition = protoLoader.loadSync(path.join(protoDir, 'tinybroker/v1/broker.proto'), {
  includeDirs: [protoDir],
  keepCase: true,
  longs: Number,
  defaults: true,
});
const { Broker } = grpc.loadPackageDefinition(definition).tinybroker.v1;
const channelOptions = JSON.parse(process.env.GRPC_JS_CHANNEL_OPTIONS || '{}');
const client = new Broker(addr, grpc.credentials.createInsecure(), channelOptions);
const topic = 'stock.grpcjs';
const receiveTimeoutMs = Number(process.env.RECEIVE_TIMEOUT_SECONDS || '90') * 1000;

const result = {
  grpc_js: require('@grpc/grpc-js/package.json').version,
  channel_options: channelOptions,
  count,
  publish_code: null,
  publish_details: null,
  accepted: null,
  received: 0,
  subscription_error: null,
  out_of_order: null,
};

function finish() {
  result.total_seconds = seconds(started);
  console.log('result ' + JSON.stringify(result));
  client.close();
  process.exit(0);
}

function seconds(since) {
  return Math.round(Number(process.hrtime.bigint() - since) / 1e7) / 100;
}

let started = process.hrtime.bigint();
let subscription = null;
let published = false;
let expected = 0;
let lastSequence = 0;

function maybeDone() {
  if (published && (!subscribe || result.received === count || result.subscription_error)) {
    if (subscription) subscription.cancel();
    finish();
  }
}

function openSubscription(then) {
  subscription = client.OpenSubscription({ topic_patterns: [topic] });
  subscription.on('metadata', () => {
    console.log('subscribed');
    then();
  });
  subscription.on('data', (message) => {
    const index = Number(message.payload.toString());
    if (result.out_of_order === null && (index !== expected || message.sequence <= lastSequence)) {
      result.out_of_order = `message ${expected} expected, got payload ${index} sequence ${message.sequence} after ${lastSequence}`;
    }
    expected = index + 1;
    lastSequence = message.sequence;
    result.received += 1;
    if (result.received === count) maybeDone();
  });
  subscription.on('error', (error) => {
    if (error.code !== grpc.status.CANCELLED || result.received !== count) {
      result.subscription_error = `${grpc.status[error.code]}: ${error.details}`;
    }
    maybeDone();
  });
}

function publish() {
  started = process.hrtime.bigint();
  const call = client.PublishStream((error, response) => {
    result.publish_seconds = seconds(started);
    if (error) {
      result.publish_code = grpc.status[error.code];
      result.publish_details = error.details;
    } else {
      result.publish_code = 'OK';
      result.accepted = response.accepted;
    }
    console.log(`published ${result.publish_code}`);
    published = true;
    if (subscribe) setTimeout(finish, receiveTimeoutMs).unref();
    maybeDone();
  });
  let i = 0;
  const write = () => {
    while (i < count) {
      if (i === pauseAt) console.log('pause');
      const payload = Buffer.from(String(i).padStart(payloadBytes, '0'));
      i += 1;
      if (!call.write({ topic, payload })) {
        call.once('drain', write);
        return;
      }
    }
    call.end();
  };
  write();
}

if (subscribe) {
  openSubscription(publish);
} else {
  publish();
}
