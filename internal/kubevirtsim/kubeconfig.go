package kubevirtsim

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/url"
	"sync"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// WriteKubeconfig writes a kubeconfig for a separate process (a driver
// binary, say) that reaches the simulated host cluster as ClientConfig does:
// through the front proxy, with the admin token, in the given namespace.
//
// The file's server is https: client-go drops a kubeconfig user's token when
// the server is plain http (clientcmd only merges credentials for TLS
// transports), so a process given the proxy's http URL would act as
// system:anonymous. WriteKubeconfig therefore starts a TLS front on
// 127.0.0.1, with a fresh certificate authority written into the file, that
// passes each connection on to the front proxy unchanged. The front serves
// until ctx is done; each call starts its own. Valid after Start.
func (s *Sim) WriteKubeconfig(ctx context.Context, path, namespace string) error {
	if s.proxy == nil {
		return errors.New("kubevirtsim: WriteKubeconfig before Start")
	}
	backend, err := url.Parse(s.proxy.url)
	if err != nil {
		return err
	}
	caPEM, cert, err := selfSignedLoopback()
	if err != nil {
		return err
	}
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{cert},
		// The front proxy speaks HTTP/1.1 only; bytes pass through unchanged.
		NextProtos: []string{"http/1.1"},
		MinVersion: tls.VersionTLS12,
	})
	if err != nil {
		return err
	}
	f := &tlsFront{ln: ln, backend: backend.Host, conns: map[net.Conn]struct{}{}}
	go f.serve()
	go func() {
		<-ctx.Done()
		f.close()
	}()

	kc := clientcmdapi.NewConfig()
	kc.Clusters["sim"] = &clientcmdapi.Cluster{Server: "https://" + ln.Addr().String(), CertificateAuthorityData: caPEM}
	kc.AuthInfos["sim"] = &clientcmdapi.AuthInfo{Token: s.c.cfg.BearerToken}
	kc.Contexts["sim"] = &clientcmdapi.Context{Cluster: "sim", AuthInfo: "sim", Namespace: namespace}
	kc.CurrentContext = "sim"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		f.close()
		return err
	}
	return nil
}

// tlsFront terminates TLS and copies bytes to and from the front proxy.
type tlsFront struct {
	ln      net.Listener
	backend string

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}
}

func (f *tlsFront) serve() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		go f.pipe(c)
	}
}

func (f *tlsFront) track(cs ...net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	for _, c := range cs {
		f.conns[c] = struct{}{}
	}
	return true
}

func (f *tlsFront) untrack(cs ...net.Conn) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range cs {
		delete(f.conns, c)
	}
}

func (f *tlsFront) pipe(client net.Conn) {
	defer client.Close()
	back, err := net.DialTimeout("tcp", f.backend, 10*time.Second)
	if err != nil {
		return
	}
	defer back.Close()
	if !f.track(client, back) {
		return
	}
	defer f.untrack(client, back)
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		// A half-closed side ends the whole exchange: HTTP/1.1 keeps no
		// half-open streams worth keeping.
		_ = dst.Close()
		_ = src.Close()
		done <- struct{}{}
	}
	go cp(back, client)
	go cp(client, back)
	<-done
	<-done
}

func (f *tlsFront) close() {
	f.mu.Lock()
	f.closed = true
	conns := f.conns
	f.conns = map[net.Conn]struct{}{}
	f.mu.Unlock()
	_ = f.ln.Close()
	for c := range conns {
		_ = c.Close()
	}
}

// selfSignedLoopback makes a certificate authority and a serving certificate
// for 127.0.0.1 signed by it; it returns the authority's PEM.
func selfSignedLoopback() ([]byte, tls.Certificate, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kubevirtsim-front-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(30 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kubevirtsim-front"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(30 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	cert, err := tls.X509KeyPair(
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}))
	if err != nil {
		return nil, tls.Certificate{}, fmt.Errorf("kubevirtsim: front certificate: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), cert, nil
}
