// A real OpenID provider for reliq's console sign-in tests (the `oidc-provider` package):
// one confidential client, PKCE required, and users whose `roles` claim maps to reliq's
// reader (rita), operator (oscar) and admin (ada), one with no reliq role (nora), and a
// reader whose access tokens expire within seconds (tess). Any password signs in (the
// package's development login and consent pages). Loopback only.
//
// Environment: OIDC_PORT, OIDC_ISSUER (default http://127.0.0.1:OIDC_PORT),
// OIDC_CLIENT_SECRET, OIDC_REDIRECT_URI, OIDC_POST_LOGOUT_URI, OIDC_SHORT_TTL (tess's
// access token lifetime in seconds, default 4).
import Provider from 'oidc-provider';

const env = (name, fallback) => {
  const value = process.env[name] ?? fallback;
  if (value === undefined) {
    console.error(`provider.mjs: ${name} is not set`);
    process.exit(2);
  }
  return value;
};

const port = Number(env('OIDC_PORT'));
const issuer = env('OIDC_ISSUER', `http://127.0.0.1:${port}`);
const shortTtl = Number(env('OIDC_SHORT_TTL', '4'));
const roles = {
  rita: ['staff', 'reliq-reader'],
  oscar: ['staff', 'reliq-operator'],
  ada: ['reliq-admin'],
  nora: ['staff'],
  tess: ['reliq-reader'],
};
const ttl = (token) => (token.accountId === 'tess' ? shortTtl : 3600);

const provider = new Provider(issuer, {
  clients: [{
    client_id: 'reliq-console',
    client_secret: env('OIDC_CLIENT_SECRET'),
    redirect_uris: [env('OIDC_REDIRECT_URI')],
    post_logout_redirect_uris: [env('OIDC_POST_LOGOUT_URI')],
    grant_types: ['authorization_code'],
    response_types: ['code'],
    token_endpoint_auth_method: 'client_secret_basic',
  }],
  pkce: { required: () => true },
  scopes: ['openid', 'profile', 'roles'],
  claims: { openid: ['sub'], profile: ['preferred_username'], roles: ['roles'] },
  // The requested scopes' claims in the ID token too (as Okta, Entra ID and Keycloak
  // can be told to do), not only at the userinfo endpoint.
  conformIdTokenClaims: false,
  findAccount: async (_ctx, id) => ({
    accountId: id,
    claims: async () => ({ sub: id, preferred_username: id, roles: roles[id] ?? [] }),
  }),
  features: {
    devInteractions: { enabled: true },
    rpInitiatedLogout: { enabled: true },
  },
  ttl: {
    AccessToken: (_ctx, token) => ttl(token),
    IdToken: (_ctx, token) => ttl(token),
  },
  cookies: { keys: ['reliq-test-only-cookie-key'] },
});

provider.listen(port, '127.0.0.1', () => {
  console.log(`oidc provider listening on ${issuer}`);
});
