// Validates AsyncAPI documents with the official parser (@asyncapi/parser, with the Avro and
// Protobuf schema parsers a reliq document may use): `node validate.mjs FILE...` prints each
// diagnostic and exits 1 when a document has an error or a warning. `--self-test FILE` checks
// that a copy of FILE with a dangling operation channel is refused (so a pass means
// something).
import { readFileSync } from 'node:fs';
import { Parser, DiagnosticSeverity } from '@asyncapi/parser';
import { AvroSchemaParser } from '@asyncapi/avro-schema-parser';
import { ProtoBuffSchemaParser } from '@asyncapi/protobuf-schema-parser';

const parser = new Parser({ schemaParsers: [AvroSchemaParser(), ProtoBuffSchemaParser()] });
const SEVERITY = ['error', 'warning', 'info', 'hint'];

async function problems(name, text) {
  const { document, diagnostics } = await parser.parse(text, { source: name });
  const failing = diagnostics.filter((d) => d.severity <= DiagnosticSeverity.Warning);
  for (const d of failing) {
    console.log(`${name}: ${SEVERITY[d.severity]} ${d.code}: ${d.message} at /${d.path.join('/')}`);
  }
  if (!document && failing.length === 0) {
    console.log(`${name}: the parser returned no document`);
    return [{ message: 'no document' }];
  }
  return failing;
}

const args = process.argv.slice(2);
if (args[0] === '--self-test') {
  const doc = JSON.parse(readFileSync(args[1], 'utf8'));
  const first = Object.keys(doc.operations)[0];
  doc.operations[first].channel = { $ref: '#/channels/no-such-channel' };
  const found = await problems(`${args[1]} (broken on purpose)`, JSON.stringify(doc));
  if (found.length === 0) {
    console.log('self-test: a document with a dangling channel reference passed');
    process.exit(1);
  }
  console.log('self-test: a broken document is refused');
  process.exit(0);
}
let bad = 0;
for (const file of args) {
  const found = await problems(file, readFileSync(file, 'utf8'));
  if (found.length) bad++;
  else console.log(`${file}: valid AsyncAPI`);
}
process.exit(bad || args.length === 0 ? 1 : 0);
