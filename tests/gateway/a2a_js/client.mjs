// The @a2a-js/sdk client against a loopmesh gateway: resolve the agent's card, stream a
// message's task to its end, read the task again. Prints one JSON object a line:
// {"card": ...}, then {"event": ...} for each stream event, then {"task": ...}.
//   node client.mjs <agent base URL> <API key> <text>
import {
  ClientFactory,
  ClientFactoryOptions,
  JsonRpcTransportFactory,
  createAuthenticatingFetchWithRetry,
} from "@a2a-js/sdk/client";

const [baseUrl, key, text] = process.argv.slice(2);
const fetchImpl = createAuthenticatingFetchWithRetry(fetch, {
  headers: async () => ({ Authorization: `Bearer ${key}` }),
  shouldRetryWithHeaders: async () => undefined,
});
const factory = new ClientFactory(
  ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl })],
  }),
);
const out = (value) => console.log(JSON.stringify(value));
const client = await factory.createFromUrl(baseUrl);
const card = await (await fetch(new URL(".well-known/agent-card.json", baseUrl))).json();
out({ card });
let taskId = "";
const stream = client.sendMessageStream({
  message: {
    messageId: crypto.randomUUID(),
    role: 1, // ROLE_USER
    parts: [{ content: { $case: "text", value: text } }],
  },
});
for await (const event of stream) {
  const payload = event.payload;
  taskId ||= payload?.value?.id || payload?.value?.taskId || "";
  out({ event: { kind: payload?.$case, value: payload?.value } });
}
out({ task: await client.getTask({ id: taskId }) });
