package kubevirtsim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/rest"
)

// subresourceGroup is the API group of virt-api's subresources.
const subresourceGroup = "subresources.kubevirt.io"

// RequestKey identifies a kind of request seen by the front proxy.
type RequestKey struct {
	// Verb is the Kubernetes verb: get, list, watch, create, update, patch,
	// delete, deletecollection.
	Verb        string
	Group       string
	Resource    string
	Subresource string
}

// Stats counts the requests that reached the front proxy (the simulator's own
// controllers bypass it).
type Stats struct {
	// Requests counts every request by kind.
	Requests map[RequestKey]int
	// Answers counts the HTTP status codes answered per kind.
	Answers map[RequestKey]map[int]int

	// VMSpecWrites counts patches and updates of virtualmachines (main
	// resource); VMStatusWrites of virtualmachines/status.
	VMSpecWrites   int
	VMStatusWrites int
	// VMIWrites counts patches and updates of virtualmachineinstances and
	// their status.
	VMIWrites int
	// AddVolume and RemoveVolume count subresource calls (VM and VMI paths).
	AddVolume    int
	RemoveVolume int
	// Conflicts counts 409 answers and Unprocessable 422 answers, any request.
	Conflicts     int
	Unprocessable int
	// Denied counts, per kind and status code, the answers in which an
	// admission webhook refused the request (a policy's answer, not a race;
	// they are in Answers, Conflicts and Unprocessable too).
	Denied map[RequestKey]map[int]int
}

// Contended returns the 409 and 422 answers that were not an admission
// webhook's refusal: the compare-and-swap and version races, which are what a
// writer's conflicts are. A policy's "no" is in Denied instead.
func (st Stats) Contended() (conflicts, unprocessable int) {
	conflicts, unprocessable = st.Conflicts, st.Unprocessable
	for _, codes := range st.Denied {
		conflicts -= codes[http.StatusConflict]
		unprocessable -= codes[http.StatusUnprocessableEntity]
	}
	return conflicts, unprocessable
}

// proxy is the front proxy: the aggregation layer's view of virt-api's
// subresources in front of the real API server, counting what clients send.
type proxy struct {
	c       *cluster
	virtAPI *virtAPI
	url     string
	srv     *http.Server
	ln      net.Listener
	rp      *httputil.ReverseProxy
	tr      http.RoundTripper
	api     *url.URL

	mu      sync.Mutex
	reqs    map[RequestKey]int
	answers map[RequestKey]map[int]int
	denied  map[RequestKey]map[int]int
}

func startProxy(c *cluster, virtAPI *virtAPI) (*proxy, error) {
	api, err := url.Parse(c.cfg.Host)
	if err != nil {
		return nil, fmt.Errorf("kubevirtsim: API server URL: %w", err)
	}
	if api.Scheme == "" {
		api, _ = url.Parse("https://" + c.cfg.Host)
	}
	tlsCfg, err := rest.TLSConfigFor(c.cfg)
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{
		TLSClientConfig:     tlsCfg,
		ForceAttemptHTTP2:   true,
		MaxIdleConnsPerHost: 100,
		IdleConnTimeout:     90 * time.Second,
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{
		c:       c,
		virtAPI: virtAPI,
		url:     "http://" + ln.Addr().String(),
		ln:      ln,
		tr:      tr,
		api:     api,
		reqs:    map[RequestKey]int{},
		answers: map[RequestKey]map[int]int{},
		denied:  map[RequestKey]map[int]int{},
	}
	p.rp = &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(api)
			r.Out.Host = api.Host
		},
		Transport:     tr,
		FlushInterval: -1, // stream watches
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if r.Context().Err() != nil {
				return
			}
			writeStatus(w, apierrors.NewServiceUnavailable(fmt.Sprintf("kubevirtsim proxy: %v", err)))
		},
	}
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	c.goRun(func() {
		if err := p.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			c.log.Error(err, "proxy stopped")
		}
	})
	return p, nil
}

func (p *proxy) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := p.srv.Shutdown(ctx); err != nil {
		_ = p.srv.Close()
	}
	if t, ok := p.tr.(*http.Transport); ok {
		t.CloseIdleConnections()
	}
}

// reqInfo is the parsed form of a Kubernetes API path.
type reqInfo struct {
	key       RequestKey
	namespace string
	name      string
}

// parseRequest follows the layout of Kubernetes API paths:
// /api/v1/... and /apis/<group>/<version>/..., optionally
// namespaces/<ns>/..., then <resource>[/<name>[/<subresource>]].
func parseRequest(r *http.Request) reqInfo {
	var info reqInfo
	parts := strings.Split(strings.Trim(r.URL.Path, "/"), "/")
	switch {
	case len(parts) >= 2 && parts[0] == "api":
		parts = parts[2:]
	case len(parts) >= 3 && parts[0] == "apis":
		info.key.Group = parts[1]
		parts = parts[3:]
	default:
		info.key.Verb = strings.ToLower(r.Method)
		info.key.Resource = "nonresource"
		return info
	}
	watchPrefix := false
	if len(parts) > 0 && parts[0] == "watch" {
		watchPrefix = true
		parts = parts[1:]
	}
	if len(parts) >= 2 && parts[0] == "namespaces" {
		info.namespace = parts[1]
		if len(parts) >= 3 && parts[2] != "status" && parts[2] != "finalize" {
			parts = parts[2:]
		} else {
			info.name = parts[1]
			parts = append([]string{"namespaces"}, parts[2:]...)
			if len(parts) > 1 {
				info.key.Subresource = parts[1]
			}
			info.key.Resource = "namespaces"
			info.key.Verb = verbFor(r, info.name, watchPrefix)
			return info
		}
	}
	if len(parts) > 0 {
		info.key.Resource = parts[0]
	}
	if len(parts) > 1 {
		info.name = parts[1]
	}
	if len(parts) > 2 {
		info.key.Subresource = strings.Join(parts[2:], "/")
	}
	info.key.Verb = verbFor(r, info.name, watchPrefix)
	return info
}

func verbFor(r *http.Request, name string, watchPrefix bool) string {
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		if watchPrefix || r.URL.Query().Get("watch") == "true" || r.URL.Query().Get("watch") == "1" {
			return "watch"
		}
		if name == "" {
			return "list"
		}
		return "get"
	case http.MethodPost:
		return "create"
	case http.MethodPut:
		return "update"
	case http.MethodPatch:
		return "patch"
	case http.MethodDelete:
		if name == "" {
			return "deletecollection"
		}
		return "delete"
	}
	return strings.ToLower(r.Method)
}

// statusRecorder counts an answer while it goes out: its code before the
// header is sent, a webhook's denial before the body bytes that show it, so
// a client that has the answer always finds it in Stats.
type statusRecorder struct {
	http.ResponseWriter
	code int
	// head keeps the start of an error answer's body, enough to tell an
	// admission webhook's denial from other failures.
	head []byte
	// answered and denied count the answer; each is called at most once.
	answered, denied func(code int)
	deniedCounted    bool
}

func (w *statusRecorder) setCode(code int) {
	if w.code != 0 {
		return
	}
	w.code = code
	w.answered(code)
}

// maxErrorHead is how much of an error answer's body statusRecorder keeps.
const maxErrorHead = 1024

// deniedByWebhook reports whether an answer is an admission webhook's
// refusal: the API server words those "admission webhook "<name>" denied the
// request", and virt-api passes the message on.
func (w *statusRecorder) deniedByWebhook() bool {
	return w.code >= 400 && bytes.Contains(w.head, []byte("admission webhook ")) && bytes.Contains(w.head, []byte("denied the request"))
}

func (w *statusRecorder) WriteHeader(code int) {
	if code >= 200 || code == http.StatusSwitchingProtocols {
		w.setCode(code) // not an informational 1xx: the answer's own code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusRecorder) Write(b []byte) (int, error) {
	w.setCode(http.StatusOK)
	if w.code >= 400 && len(w.head) < maxErrorHead {
		w.head = append(w.head, b[:min(len(b), maxErrorHead-len(w.head))]...)
		if !w.deniedCounted && w.deniedByWebhook() {
			w.deniedCounted = true
			w.denied(w.code)
		}
	}
	return w.ResponseWriter.Write(b)
}

func (w *statusRecorder) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *statusRecorder) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (p *proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	info := parseRequest(r)
	p.mu.Lock()
	p.reqs[info.key]++
	p.mu.Unlock()
	count := func(denied bool) func(int) {
		return func(code int) {
			p.mu.Lock()
			defer p.mu.Unlock()
			into := p.answers // read under the lock: reset replaces it
			if denied {
				into = p.denied
			}
			m := into[info.key]
			if m == nil {
				m = map[int]int{}
				into[info.key] = m
			}
			m[code]++
		}
	}
	rec := &statusRecorder{ResponseWriter: w, answered: count(false), denied: count(true)}
	// An answer the handler wrote nothing for is sent as 200 once it
	// returns: count it before that.
	defer rec.setCode(http.StatusOK)

	if info.key.Group == subresourceGroup {
		sub := info.key.Subresource
		if (info.key.Resource == resVMs || info.key.Resource == resVMIs) && (sub == "addvolume" || sub == "removevolume") && info.namespace != "" && info.name != "" {
			if r.Method != http.MethodPut {
				writeStatus(rec, apierrors.NewMethodNotSupported(schema.GroupResource{Group: subresourceGroup, Resource: info.key.Resource + "/" + sub}, r.Method))
				return
			}
			if !p.authorize(rec, r, info) {
				return
			}
			p.virtAPI.serve(rec, r, info)
			return
		}
		writeStatus(rec, apierrors.NewNotFound(schema.GroupResource{Group: subresourceGroup, Resource: info.key.Resource}, info.name))
		return
	}
	p.rp.ServeHTTP(rec, r)
}

// authorize asks the API server, with the caller's own credentials, whether
// the caller may "update <resource>/<subresource>" in subresources.kubevirt.io,
// as the aggregation layer does before a request reaches virt-api.
func (p *proxy) authorize(w http.ResponseWriter, r *http.Request, info reqInfo) bool {
	ssar := &authzv1.SelfSubjectAccessReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "authorization.k8s.io/v1", Kind: "SelfSubjectAccessReview"},
		Spec: authzv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authzv1.ResourceAttributes{
			Namespace: info.namespace, Verb: "update", Group: subresourceGroup,
			Resource: info.key.Resource, Subresource: info.key.Subresource, Name: info.name,
		}},
	}
	var out authzv1.SelfSubjectAccessReview
	code, err := p.callAPI(r.Context(), r.Header.Get("Authorization"), "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", ssar, &out)
	if err != nil {
		writeStatus(w, apierrors.NewInternalError(fmt.Errorf("authorization check: %v", err)))
		return false
	}
	switch {
	case code == http.StatusUnauthorized:
		writeStatus(w, apierrors.NewUnauthorized("Unauthorized"))
		return false
	case code == http.StatusForbidden:
		out.Status.Allowed = false // may not even ask: not allowed either
	case code != http.StatusCreated && code != http.StatusOK:
		writeStatus(w, apierrors.NewInternalError(fmt.Errorf("authorization check: HTTP %d", code)))
		return false
	}
	if out.Status.Allowed {
		return true
	}
	user := "system:anonymous"
	var who authnv1.SelfSubjectReview
	if c, err := p.callAPI(r.Context(), r.Header.Get("Authorization"), "/apis/authentication.k8s.io/v1/selfsubjectreviews",
		&authnv1.SelfSubjectReview{TypeMeta: metav1.TypeMeta{APIVersion: "authentication.k8s.io/v1", Kind: "SelfSubjectReview"}}, &who); err == nil && c < 300 {
		user = who.Status.UserInfo.Username
	}
	writeStatus(w, apierrors.NewForbidden(schema.GroupResource{Group: subresourceGroup, Resource: info.key.Resource}, info.name,
		fmt.Errorf("User %q cannot update resource %q in API group %q in the namespace %q", user, info.key.Resource+"/"+info.key.Subresource, subresourceGroup, info.namespace)))
	return false
}

func (p *proxy) callAPI(ctx context.Context, authz, path string, in, out any) (int, error) {
	body, err := json.Marshal(in)
	if err != nil {
		return 0, err
	}
	u := *p.api
	u.Path = strings.TrimSuffix(u.Path, "/") + path
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	if authz != "" {
		req.Header.Set("Authorization", authz)
	}
	resp, err := p.tr.RoundTrip(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return resp.StatusCode, err
	}
	if resp.StatusCode < 300 {
		if err := json.Unmarshal(data, out); err != nil {
			return resp.StatusCode, err
		}
	}
	return resp.StatusCode, nil
}

// writeStatus writes err as a metav1.Status the way the API server does.
func writeStatus(w http.ResponseWriter, err *apierrors.StatusError) {
	st := err.Status()
	st.TypeMeta = metav1.TypeMeta{Kind: "Status", APIVersion: "v1"}
	if st.Status == "" {
		st.Status = metav1.StatusFailure
	}
	data, _ := json.Marshal(st)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(int(st.Code))
	_, _ = w.Write(data)
}

// stats returns a snapshot of the counters (empty before Start).
func (p *proxy) stats() Stats {
	if p == nil {
		return Stats{Requests: map[RequestKey]int{}, Answers: map[RequestKey]map[int]int{}, Denied: map[RequestKey]map[int]int{}}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	st := Stats{Requests: maps.Clone(p.reqs), Answers: map[RequestKey]map[int]int{}, Denied: map[RequestKey]map[int]int{}}
	for k, m := range p.answers {
		st.Answers[k] = maps.Clone(m)
	}
	for k, m := range p.denied {
		st.Denied[k] = maps.Clone(m)
	}
	for k, n := range p.reqs {
		write := k.Verb == "patch" || k.Verb == "update"
		switch {
		case k.Group == "kubevirt.io" && k.Resource == resVMs && k.Subresource == "" && write:
			st.VMSpecWrites += n
		case k.Group == "kubevirt.io" && k.Resource == resVMs && k.Subresource == "status" && write:
			st.VMStatusWrites += n
		case k.Group == "kubevirt.io" && k.Resource == resVMIs && (k.Subresource == "" || k.Subresource == "status") && write:
			st.VMIWrites += n
		case k.Group == subresourceGroup && k.Subresource == "addvolume":
			st.AddVolume += n
		case k.Group == subresourceGroup && k.Subresource == "removevolume":
			st.RemoveVolume += n
		}
	}
	for _, m := range p.answers {
		st.Conflicts += m[http.StatusConflict]
		st.Unprocessable += m[http.StatusUnprocessableEntity]
	}
	return st
}

// reset zeroes the counters.
func (p *proxy) reset() {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.reqs = map[RequestKey]int{}
	p.answers = map[RequestKey]map[int]int{}
	p.denied = map[RequestKey]map[int]int{}
	p.mu.Unlock()
}
