package testenv

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/client-go/rest"
)

// User is an identity of the API server's token file, for processes that must
// act as someone other than the admin (KubeVirt's admission lets only its own
// service accounts change a VMI's spec, for example).
type User struct {
	Name   string
	Groups []string
}

// ServiceAccountUser is the identity the API server gives a pod running under
// the service account namespace/name: the same user name and groups, so the
// RBAC bindings written for that service account apply as they are.
func ServiceAccountUser(namespace, name string) User {
	return User{
		Name:   "system:serviceaccount:" + namespace + ":" + name,
		Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + namespace},
	}
}

// tokenFile writes the API server's token file: the admin, then opts.Users.
func (e *Env) tokenFile(adminToken string, users []User) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "%s,admin,admin,\"system:masters\"\n", adminToken)
	e.tokens = map[string]string{}
	for _, u := range users {
		if strings.ContainsAny(u.Name, ",\"\n") {
			return "", fmt.Errorf("user name %q cannot be written to a token file", u.Name)
		}
		tok, err := randomHex(16)
		if err != nil {
			return "", err
		}
		e.tokens[u.Name] = tok
		fmt.Fprintf(&b, "%s,%s,%s,\"%s\"\n", tok, u.Name, u.Name, strings.Join(u.Groups, ","))
	}
	path := filepath.Join(e.Dir, "tokens.csv")
	return path, os.WriteFile(path, []byte(b.String()), 0o600)
}

// UserConfig reaches the API server as one of Options.Users.
func (e *Env) UserConfig(name string) (*rest.Config, error) {
	tok, ok := e.tokens[name]
	if !ok {
		return nil, fmt.Errorf("no token-file user %q: list it in Options.Users", name)
	}
	cfg := rest.CopyConfig(e.Config)
	cfg.BearerToken = tok
	return cfg, nil
}

// UserKubeconfig writes a kubeconfig for one of Options.Users into Dir and
// returns its path, for child processes that run as that user.
func (e *Env) UserKubeconfig(name, namespace string) (string, error) {
	cfg, err := e.UserConfig(name)
	if err != nil {
		return "", err
	}
	path := filepath.Join(e.Dir, "kubeconfig-"+strings.NewReplacer(":", "_", "/", "_").Replace(name))
	return path, WriteKubeconfig(path, cfg, namespace)
}

// aggregationArgs writes the front-proxy CA and the client certificate the
// aggregator presents to extension API servers, and returns the API server
// flags that use them. The CN front-proxy-client and the X-Remote-* headers
// are what kubeadm configures; extension servers read the CA and the header
// names from kube-system/extension-apiserver-authentication, which the API
// server publishes only when these flags are set.
func (e *Env) aggregationArgs() ([]string, error) {
	dir := filepath.Join(e.Dir, "front-proxy")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ca, err := NewCA("front-proxy-ca")
	if err != nil {
		return nil, err
	}
	caFile := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(caFile, ca.CertPEM, 0o600); err != nil {
		return nil, err
	}
	certPEM, keyPEM, err := ca.Issue("front-proxy-client", nil, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return nil, err
	}
	certFile, keyFile := filepath.Join(dir, "client.crt"), filepath.Join(dir, "client.key")
	if err := os.WriteFile(certFile, certPEM, 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(keyFile, keyPEM, 0o600); err != nil {
		return nil, err
	}
	return []string{
		"--requestheader-client-ca-file=" + caFile,
		"--requestheader-allowed-names=front-proxy-client",
		"--requestheader-username-headers=X-Remote-User",
		"--requestheader-group-headers=X-Remote-Group",
		"--requestheader-extra-headers-prefix=X-Remote-Extra-",
		"--proxy-client-cert-file=" + certFile,
		"--proxy-client-key-file=" + keyFile,
	}, nil
}

// CA is a self-signed certificate authority for test servers and clients.
type CA struct {
	CertPEM []byte
	cert    *x509.Certificate
	key     *rsa.PrivateKey
}

// NewCA makes a CA valid for a day, longer than any test or lab run.
func NewCA(cn string) (*CA, error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: cn},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), cert: cert, key: key}, nil
}

// Issue signs a certificate for cn; hosts become DNS or IP subject
// alternative names, as a serving certificate needs.
func (c *CA) Issue(cn string, hosts []string, usage ...x509.ExtKeyUsage) (certPEM, keyPEM []byte, err error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     c.cert.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  usage,
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	if err != nil {
		return nil, nil, err
	}
	certPEM = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM = pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)})
	return certPEM, keyPEM, nil
}

// LoopbackServing makes a CA named cn and a serving certificate it signed
// for 127.0.0.1, for a test server the API server or a client reaches on
// the loopback address: caPEM is what they trust (a webhook's caBundle, a
// kubeconfig's certificate-authority-data).
func LoopbackServing(cn string) (caPEM []byte, cert tls.Certificate, err error) {
	ca, err := NewCA(cn + "-ca")
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	certPEM, keyPEM, err := ca.Issue(cn, []string{"127.0.0.1"}, x509.ExtKeyUsageServerAuth)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	if cert, err = tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return nil, tls.Certificate{}, err
	}
	return ca.CertPEM, cert, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		// crypto/rand does not fail on Linux; a fixed serial is still a valid certificate.
		return big.NewInt(1)
	}
	return n
}
