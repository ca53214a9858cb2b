// A stand-in for AWS MSK's IAM authentication on the secured Kafka node's MSKIAM
// listener (scripts/brokers.d/secure.sh): it accepts the OAUTHBEARER token AWS's
// `aws-msk-iam-sasl-signer` libraries make, and reliq's `aws_msk_iam` method: a SigV4
// presigned `kafka-cluster:Connect` GET request, base64url-encoded without padding.
//
// It checks what MSK checks of the request itself: the action, the algorithm, the
// credential scope (`kafka-cluster` in the host's region), that it is signed for now
// (X-Amz-Date within five minutes, X-Amz-Expires not passed, at most 15 minutes), and
// the signature, recomputed with the secret of the access key. The secrets come from
// the listener's JAAS options, `key_<ACCESS_KEY_ID>="<secret>"`, as PLAIN's users do.
// The principal is `User:<ACCESS_KEY_ID>` (MSK's is the IAM identity's ARN). A session
// token is signed but, having no STS here, not checked against one.
//
// Built by scripts/brokers against the broker's own jars; no dependency beyond them.

import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;
import javax.security.auth.callback.Callback;
import javax.security.auth.callback.UnsupportedCallbackException;
import javax.security.auth.login.AppConfigurationEntry;

import org.apache.kafka.common.security.auth.AuthenticateCallbackHandler;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerExtensionsValidatorCallback;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerToken;
import org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallback;

public class MskIamValidator implements AuthenticateCallbackHandler {
    private static final DateTimeFormatter AMZ_DATE =
        DateTimeFormatter.ofPattern("yyyyMMdd'T'HHmmss'Z'").withZone(ZoneOffset.UTC);
    private static final long SKEW_MS = 5 * 60 * 1000;
    private final Map<String, String> secrets = new HashMap<>();

    @Override
    public void configure(Map<String, ?> configs, String mechanism, List<AppConfigurationEntry> entries) {
        for (AppConfigurationEntry entry : entries) {
            for (Map.Entry<String, ?> option : entry.getOptions().entrySet()) {
                if (option.getKey().startsWith("key_")) {
                    secrets.put(option.getKey().substring(4), String.valueOf(option.getValue()));
                }
            }
        }
    }

    @Override
    public void handle(Callback[] callbacks) throws UnsupportedCallbackException {
        for (Callback callback : callbacks) {
            if (callback instanceof OAuthBearerValidatorCallback) {
                OAuthBearerValidatorCallback validation = (OAuthBearerValidatorCallback) callback;
                try {
                    validation.token(validate(validation.tokenValue()));
                } catch (IllegalArgumentException | java.security.GeneralSecurityException e) {
                    validation.error("invalid_token", null, null);
                }
            } else if (callback instanceof OAuthBearerExtensionsValidatorCallback) {
                // No extensions are expected; any sent are ignored, as MSK does.
            } else {
                throw new UnsupportedCallbackException(callback);
            }
        }
    }

    private OAuthBearerToken validate(String token) throws java.security.GeneralSecurityException {
        String url = new String(Base64.getUrlDecoder().decode(token), StandardCharsets.UTF_8);
        String prefix = "https://";
        int query = url.indexOf("/?");
        if (!url.startsWith(prefix) || query < 0) throw new IllegalArgumentException("not a presigned URL");
        String host = url.substring(prefix.length(), query);
        if (!host.startsWith("kafka.") || !host.endsWith(".amazonaws.com")) throw new IllegalArgumentException("host");
        String region = host.substring("kafka.".length(), host.length() - ".amazonaws.com".length());
        Map<String, String> params = new TreeMap<>();
        String signature = null;
        for (String pair : url.substring(query + 2).split("&")) {
            int eq = pair.indexOf('=');
            if (eq < 0) throw new IllegalArgumentException("parameter");
            String name = URLDecoder.decode(pair.substring(0, eq), StandardCharsets.UTF_8);
            String value = URLDecoder.decode(pair.substring(eq + 1), StandardCharsets.UTF_8);
            if (name.equals("X-Amz-Signature")) signature = value;
            else if (!name.equals("User-Agent")) params.put(name, value);
        }
        if (!"kafka-cluster:Connect".equals(params.get("Action"))) throw new IllegalArgumentException("action");
        if (!"AWS4-HMAC-SHA256".equals(params.get("X-Amz-Algorithm"))) throw new IllegalArgumentException("algorithm");
        if (!"host".equals(params.get("X-Amz-SignedHeaders"))) throw new IllegalArgumentException("signed headers");
        String[] credential = String.valueOf(params.get("X-Amz-Credential")).split("/");
        String amzDate = String.valueOf(params.get("X-Amz-Date"));
        if (credential.length != 5 || !credential[2].equals(region) || !credential[3].equals("kafka-cluster")
            || !credential[4].equals("aws4_request") || !amzDate.startsWith(credential[1])) {
            throw new IllegalArgumentException("credential scope");
        }
        String secret = secrets.get(credential[0]);
        if (secret == null || signature == null) throw new IllegalArgumentException("unknown access key");
        long signedAt = Instant.from(AMZ_DATE.parse(amzDate)).toEpochMilli();
        long expires = Long.parseLong(String.valueOf(params.get("X-Amz-Expires")));
        long now = System.currentTimeMillis();
        if (expires <= 0 || expires > 900 || signedAt > now + SKEW_MS || now > signedAt + expires * 1000) {
            throw new IllegalArgumentException("not signed for now");
        }
        List<String> canonicalQuery = new ArrayList<>();
        for (Map.Entry<String, String> p : params.entrySet()) {
            canonicalQuery.add(encode(p.getKey()) + "=" + encode(p.getValue()));
        }
        String canonicalRequest = String.join("\n", "GET", "/", String.join("&", canonicalQuery),
            "host:" + host, "", "host", hex(sha256(new byte[0])));
        String scope = String.join("/", credential[1], region, "kafka-cluster", "aws4_request");
        String toSign = String.join("\n", "AWS4-HMAC-SHA256", amzDate, scope,
            hex(sha256(canonicalRequest.getBytes(StandardCharsets.UTF_8))));
        byte[] key = ("AWS4" + secret).getBytes(StandardCharsets.UTF_8);
        for (String part : new String[] {credential[1], region, "kafka-cluster", "aws4_request"}) {
            key = hmac(key, part);
        }
        byte[] expected = hex(hmac(key, toSign)).getBytes(StandardCharsets.UTF_8);
        if (!MessageDigest.isEqual(expected, signature.getBytes(StandardCharsets.UTF_8))) {
            throw new IllegalArgumentException("signature");
        }
        String principal = credential[0];
        long lifetime = signedAt + expires * 1000;
        return new OAuthBearerToken() {
            public String value() { return token; }
            public Set<String> scope() { return Set.of(); }
            public long lifetimeMs() { return lifetime; }
            public String principalName() { return principal; }
            public Long startTimeMs() { return signedAt; }
        };
    }

    private static String encode(String s) {
        StringBuilder out = new StringBuilder();
        for (byte b : s.getBytes(StandardCharsets.UTF_8)) {
            char c = (char) (b & 0xff);
            if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9')
                || c == '-' || c == '_' || c == '.' || c == '~') {
                out.append(c);
            } else {
                out.append(String.format("%%%02X", b & 0xff));
            }
        }
        return out.toString();
    }

    private static byte[] sha256(byte[] data) throws java.security.GeneralSecurityException {
        return MessageDigest.getInstance("SHA-256").digest(data);
    }

    private static byte[] hmac(byte[] key, String data) throws java.security.GeneralSecurityException {
        Mac mac = Mac.getInstance("HmacSHA256");
        mac.init(new SecretKeySpec(key, "HmacSHA256"));
        return mac.doFinal(data.getBytes(StandardCharsets.UTF_8));
    }

    private static String hex(byte[] bytes) {
        StringBuilder out = new StringBuilder();
        for (byte b : bytes) out.append(String.format("%02x", b & 0xff));
        return out.toString();
    }

    @Override
    public void close() {}
}
