package kubevirtsim

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/url"
	"sync"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
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
	caPEM, cert, err := testenv.LoopbackServing("kubevirtsim-front")
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
