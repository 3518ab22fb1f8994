package framework

import (
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/rest"
)

// withInformerLag puts a proxy in front of cfg's API server that hands every
// watch stream to the client lag late, chunk by chunk and in order, as a slow
// or congested connection does. Every other request passes at once, so live
// reads and writes see the truth while the informers lag behind it.
func withInformerLag(tb testing.TB, cfg *rest.Config, lag time.Duration) *rest.Config {
	tb.Helper()
	target, err := url.Parse(cfg.Host)
	if err != nil {
		tb.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	// The real control plane's host is the API server itself, over TLS (the
	// simulator's front proxy speaks plain HTTP): the proxy then needs the
	// config's TLS settings, and the client in front of it none.
	tlsCfg := rest.CopyConfig(cfg)
	tlsCfg.BearerToken, tlsCfg.BearerTokenFile = "", ""
	if proxy.Transport, err = rest.TransportFor(tlsCfg); err != nil {
		tb.Fatal(err)
	}
	proxy.FlushInterval = -1 // stream watch events as they come out of the lag
	proxy.ModifyResponse = func(resp *http.Response) error {
		if isWatch(resp.Request) {
			resp.Body = newLagBody(resp.Body, lag)
		}
		return nil
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv := &http.Server{Handler: proxy, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	tb.Cleanup(func() { _ = srv.Close() })
	out := rest.CopyConfig(cfg)
	out.Host = "http://" + l.Addr().String()
	out.TLSClientConfig = rest.TLSClientConfig{}
	return out
}

func isWatch(r *http.Request) bool {
	w := r.URL.Query().Get("watch")
	return w == "true" || w == "1" || strings.Contains(r.URL.Path, "/watch/")
}

type lagChunk struct {
	at   time.Time
	data []byte
}

// lagBody reads its source as fast as it comes and releases each chunk lag
// after it arrived.
type lagBody struct {
	src  io.ReadCloser
	lag  time.Duration
	ch   chan lagChunk
	err  error // the source's end, valid once ch is closed
	cur  []byte
	done chan struct{}
}

func newLagBody(src io.ReadCloser, lag time.Duration) *lagBody {
	b := &lagBody{src: src, lag: lag, ch: make(chan lagChunk, 1024), done: make(chan struct{})}
	go func() {
		defer close(b.ch)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				select {
				case b.ch <- lagChunk{at: time.Now(), data: buf[:n]}:
				case <-b.done:
					return
				}
			}
			if err != nil {
				b.err = err
				return
			}
		}
	}()
	return b
}

func (b *lagBody) Read(p []byte) (int, error) {
	if len(b.cur) == 0 {
		c, ok := <-b.ch
		if !ok {
			if b.err == nil {
				return 0, io.EOF
			}
			return 0, b.err
		}
		if wait := time.Until(c.at.Add(b.lag)); wait > 0 {
			select {
			case <-time.After(wait):
			case <-b.done:
				return 0, io.ErrClosedPipe
			}
		}
		b.cur = c.data
	}
	n := copy(p, b.cur)
	b.cur = b.cur[n:]
	return n, nil
}

func (b *lagBody) Close() error {
	select {
	case <-b.done:
	default:
		close(b.done)
	}
	return b.src.Close()
}
