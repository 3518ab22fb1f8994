package host

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/oauth2"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/transport"
)

// kubeconfigToken serves the bearer token of a kubeconfig file and reads the
// file again whenever it changes, so a rotated token (hack/host-rbac.sh
// --rotate rewrites the guest Secret; the kubelet updates the mounted file)
// takes effect without restarting the driver. It also says when the token
// expires, when the token is a JWT that carries its expiry (what a
// TokenRequest issues).
type kubeconfigToken struct {
	path string

	mu      sync.Mutex
	modTime time.Time
	size    int64
	token   string
	expiry  time.Time
}

// reloadToken makes cfg take its bearer token from the kubeconfig at path on
// every request, read again when the file changes, when that kubeconfig
// authenticates with a token written into it. It returns nil (and leaves cfg
// alone) for every other kind of credentials: a token file, which client-go
// already reads again, client certificates, or an exec plugin.
func reloadToken(cfg *rest.Config, path string) (*kubeconfigToken, error) {
	if cfg.BearerToken == "" || cfg.BearerTokenFile != "" || cfg.ExecProvider != nil || cfg.AuthProvider != nil {
		return nil, nil
	}
	k := &kubeconfigToken{path: path}
	if _, err := k.Token(); err != nil {
		return nil, err
	}
	cfg.BearerToken = ""
	cfg.WrapTransport = transport.Wrappers(cfg.WrapTransport, transport.TokenSourceWrapTransport(k))
	return k, nil
}

// Token implements oauth2.TokenSource. A file that cannot be read or holds
// no token keeps the last good token: a Secret being updated is replaced
// atomically, but a hand-edited file may be read half-written.
func (k *kubeconfigToken) Token() (*oauth2.Token, error) {
	st, statErr := os.Stat(k.path)
	k.mu.Lock()
	defer k.mu.Unlock()
	if statErr == nil && (!st.ModTime().Equal(k.modTime) || st.Size() != k.size) {
		tok, err := tokenOf(k.path)
		switch {
		case err == nil:
			k.token, k.modTime, k.size = tok, st.ModTime(), st.Size()
			k.expiry, _ = jwtExpiry(tok)
		case k.token == "":
			return nil, err
		}
	}
	if k.token == "" {
		return nil, fmt.Errorf("host kubeconfig %s: %w", k.path, statErr)
	}
	return &oauth2.Token{AccessToken: k.token, TokenType: "Bearer"}, nil
}

// Expiry is when the current token expires; ok is false when the token
// does not say (a token that is not a JWT, or one without "exp", such as a
// legacy ServiceAccount token Secret's).
func (k *kubeconfigToken) Expiry() (t time.Time, ok bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.expiry, !k.expiry.IsZero()
}

// tokenOf reads the bearer token of the current context's user.
func tokenOf(path string) (string, error) {
	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		&clientcmd.ClientConfigLoadingRules{ExplicitPath: path}, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return "", fmt.Errorf("host kubeconfig %s: %w", path, err)
	}
	if cfg.BearerToken == "" {
		return "", fmt.Errorf("host kubeconfig %s: the current user has no token", path)
	}
	return cfg.BearerToken, nil
}

// jwtExpiry reads the "exp" claim of a JWT without verifying it: the API
// server verifies the token; the driver only wants to warn before it lapses.
func jwtExpiry(token string) (time.Time, error) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return time.Time{}, errors.New("not a JWT")
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}, fmt.Errorf("JWT payload: %w", err)
	}
	var claims struct {
		Exp *json.Number `json:"exp"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil {
		return time.Time{}, fmt.Errorf("JWT payload: %w", err)
	}
	if claims.Exp == nil {
		return time.Time{}, errors.New("the JWT has no expiry")
	}
	secs, err := claims.Exp.Float64()
	if err != nil {
		return time.Time{}, fmt.Errorf("JWT exp: %w", err)
	}
	return time.Unix(int64(secs), 0), nil
}
