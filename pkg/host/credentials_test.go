package host

import (
	"context"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// jwt is an unsigned token with the given payload: the driver reads the
// claims only, the API server verifies.
func jwt(payload string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc([]byte(payload)) + ".c2ln"
}

func writeKubeconfig(t *testing.T, path, server, token string) {
	t.Helper()
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: h, cluster: {server: %q, insecure-skip-tls-verify: true}}]
users: [{name: u, user: {token: %q}}]
contexts: [{name: c, context: {cluster: h, user: u, namespace: guests}}]
current-context: c
`, server, token)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	// As the kubelet updates a mounted Secret: the new file replaces the
	// old one at once.
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// A token rotated in the kubeconfig file is used by the next request of the
// clients built at start-up: rotation needs no restart.
func TestRotatedTokenIsUsedWithoutRestart(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	// HTTPS: client-go sends a kubeconfig's credentials only over TLS.
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Header.Get("Authorization"))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"kind":"PersistentVolumeClaimList","apiVersion":"v1","items":[]}`)
	}))
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "cloud-config")
	first := jwt(`{"exp":1893456000,"sub":"system:serviceaccount:guests:harvester-csi-driver"}`)
	writeKubeconfig(t, path, srv.URL, first)
	c, err := Load(path, 5, 10)
	if err != nil {
		t.Fatal(err)
	}
	if exp, ok := c.TokenExpiry(); !ok || !exp.Equal(time.Unix(1893456000, 0)) {
		t.Errorf("expiry %v %v, want %v", exp, ok, time.Unix(1893456000, 0))
	}
	list := func() {
		t.Helper()
		if _, err := c.Kube.CoreV1().PersistentVolumeClaims("guests").List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	list()
	second := jwt(`{"exp":1900000000}`)
	writeKubeconfig(t, path, srv.URL, second+"  ")
	list()
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 || seen[0] != "Bearer "+first || seen[1] != "Bearer "+second {
		t.Errorf("Authorization headers %q, want the first token, then the rotated one", seen)
	}
	if exp, _ := c.TokenExpiry(); !exp.Equal(time.Unix(1900000000, 0)) {
		t.Errorf("expiry after rotation %v", exp)
	}
}

func TestJWTExpiry(t *testing.T) {
	for token, want := range map[string]bool{
		jwt(`{"exp":1893456000}`):   true,
		jwt(`{"exp":1.893456e+09}`): true,
		jwt(`{"sub":"x"}`):          false, // a legacy token Secret's: no expiry
		"opaque-static-token":       false,
		"a.!!!.c":                   false,
	} {
		got, err := jwtExpiry(token)
		if (err == nil) != want || (want && !got.Equal(time.Unix(1893456000, 0))) {
			t.Errorf("%q: %v, %v", token, got, err)
		}
	}
}
