// Signing admin requests in the browser, exactly as mlxppctl does (mlxppd/wire/admin_auth.py).
// The canonical request is method, path, ts, nonce, the body's SHA-256, the cluster's name and
// the Host header, one a line. With an operator key (its file's line, NAME:BASE64):
// Authorization: MLXPP-ED25519 name=<name>,ts=<unix s>,nonce=<32 hex>,sig=<base64>, an Ed25519
// signature of "MLXPP-ED25519\n<name>\n" and the canonical request, made by WebCrypto, which
// browsers offer only to a secure context (https, or localhost). With the legacy admin key
// (64 hex digits): Authorization: MLXPP-HMAC ts=..,nonce=..,mac=<64 hex>, an HMAC-SHA256 of the
// canonical request, by WebCrypto where there is one, else by the small SHA-256 below (plain
// http on a LAN address), with the same result.
"use strict";

const MlxppSign = (() => {
  const K = new Uint32Array([
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
  ]);

  // FIPS 180-4 SHA-256 of a byte array.
  function sha256(bytes) {
    const bitLength = bytes.length * 8;
    const padded = new Uint8Array(Math.ceil((bytes.length + 9) / 64) * 64);
    padded.set(bytes);
    padded[bytes.length] = 0x80;
    const view = new DataView(padded.buffer);
    view.setUint32(padded.length - 8, Math.floor(bitLength / 2 ** 32));
    view.setUint32(padded.length - 4, bitLength >>> 0);
    const h = new Uint32Array([
      0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
      0x5be0cd19,
    ]);
    const w = new Uint32Array(64);
    const rotr = (x, n) => (x >>> n) | (x << (32 - n));
    for (let block = 0; block < padded.length; block += 64) {
      for (let i = 0; i < 16; i++) w[i] = view.getUint32(block + i * 4);
      for (let i = 16; i < 64; i++) {
        const s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >>> 3);
        const s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >>> 10);
        w[i] = (w[i - 16] + s0 + w[i - 7] + s1) >>> 0;
      }
      let [a, b, c, d, e, f, g, hh] = h;
      for (let i = 0; i < 64; i++) {
        const t1 = (hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i]) >>> 0;
        const t2 = ((rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))) >>> 0;
        hh = g; g = f; f = e; e = (d + t1) >>> 0; d = c; c = b; b = a; a = (t1 + t2) >>> 0;
      }
      const add = [a, b, c, d, e, f, g, hh];
      for (let i = 0; i < 8; i++) h[i] = (h[i] + add[i]) >>> 0;
    }
    const out = new Uint8Array(32);
    const outView = new DataView(out.buffer);
    for (let i = 0; i < 8; i++) outView.setUint32(i * 4, h[i]);
    return out;
  }

  function hmacSha256(key, message) {
    let k = key.length > 64 ? sha256(key) : key;
    const block = new Uint8Array(64);
    block.set(k);
    const inner = new Uint8Array(64 + message.length);
    const outer = new Uint8Array(64 + 32);
    for (let i = 0; i < 64; i++) {
      inner[i] = block[i] ^ 0x36;
      outer[i] = block[i] ^ 0x5c;
    }
    inner.set(message, 64);
    outer.set(sha256(inner), 64);
    return sha256(outer);
  }

  const hex = (bytes) => Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");

  function keyBytes(text) {
    const clean = text.trim().toLowerCase();
    if (!/^[0-9a-f]{64}$/.test(clean)) {
      throw new Error(
        "the admin key is your operator key file's line (NAME:BASE64, from `mlxppctl " +
          "operator-key new`) or, on a cluster without [operators], 64 hex digits from " +
          "`mlxppctl secret admin-key SECRET_FILE`"
      );
    }
    return Uint8Array.from(clean.match(/../g), (pair) => parseInt(pair, 16));
  }

  // An operator key file's one line: the operator's name, then 32 private bytes in base64.
  const OPERATOR_LINE = /^([A-Za-z0-9._-]{1,255}):([A-Za-z0-9+/]{43}=)$/;
  // PKCS #8 of an Ed25519 private key is this fixed DER prefix and the 32 bytes (RFC 8410).
  const PKCS8_PREFIX = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
  ];

  function operatorKey(text) {
    const match = OPERATOR_LINE.exec(text.trim());
    if (!match) return null;
    const pkcs8 = new Uint8Array(PKCS8_PREFIX.length + 32);
    pkcs8.set(PKCS8_PREFIX);
    pkcs8.set(Uint8Array.from(atob(match[2]), (c) => c.charCodeAt(0)), PKCS8_PREFIX.length);
    return { name: match[1], pkcs8 };
  }

  const base64 = (bytes) => btoa(String.fromCharCode(...bytes));

  async function ed25519(pkcs8, message) {
    if (!(globalThis.crypto && crypto.subtle)) {
      throw new Error(
        "an operator key signs with the browser's WebCrypto, which it offers only to a page on " +
          "https or localhost: open the console over https (tls_cert_file) or through " +
          "localhost, or use mlxppctl --operator-key"
      );
    }
    let key;
    try {
      key = await crypto.subtle.importKey("pkcs8", pkcs8, { name: "Ed25519" }, false, ["sign"]);
    } catch (error) {
      throw new Error(
        error && error.name === "NotSupportedError"
          ? "this browser's WebCrypto has no Ed25519: use a current Chrome, Firefox or Safari, " +
            "or mlxppctl --operator-key"
          : "the operator key does not import: paste the whole line of the key file again"
      );
    }
    return new Uint8Array(await crypto.subtle.sign({ name: "Ed25519" }, key, message));
  }

  async function digest(bytes) {
    if (globalThis.crypto && crypto.subtle) {
      return new Uint8Array(await crypto.subtle.digest("SHA-256", bytes));
    }
    return sha256(bytes);
  }

  async function mac(key, message) {
    if (globalThis.crypto && crypto.subtle) {
      const imported = await crypto.subtle.importKey(
        "raw", key, { name: "HMAC", hash: "SHA-256" }, false, ["sign"]
      );
      return new Uint8Array(await crypto.subtle.sign("HMAC", imported, message));
    }
    return hmacSha256(key, message);
  }

  // The Authorization header for one request. `path` as sent (query included), `body` the
  // exact bytes sent, `host` the Host header the browser sends (location.host).
  async function authorization(keyText, method, path, body, cluster, host, nowSeconds) {
    const operator = operatorKey(keyText);
    const key = operator ? null : keyBytes(keyText);
    const nonceBytes = new Uint8Array(16);
    crypto.getRandomValues(nonceBytes);
    const nonce = hex(nonceBytes);
    const ts = String(Math.floor(nowSeconds));
    const canonical = [
      method.toUpperCase(), path, ts, nonce, hex(await digest(body)), cluster, host.toLowerCase(),
    ].join("\n");
    if (operator) {
      const signed = `MLXPP-ED25519\n${operator.name}\n${canonical}`;
      const sig = base64(await ed25519(operator.pkcs8, new TextEncoder().encode(signed)));
      return `MLXPP-ED25519 name=${operator.name},ts=${ts},nonce=${nonce},sig=${sig}`;
    }
    const signature = hex(await mac(key, new TextEncoder().encode(canonical)));
    return `MLXPP-HMAC ts=${ts},nonce=${nonce},mac=${signature}`;
  }

  return { authorization, sha256, hmacSha256, hex, keyBytes, operatorKey };
})();
