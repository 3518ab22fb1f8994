// Package testenv runs a real etcd and kube-apiserver (and, on request, the
// kube-controller-manager and external-attacher) from the binaries that
// hack/tools.sh builds, for integration tests and the local lab.
package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// Env is a running control plane. Stop it when done.
type Env struct {
	// Config reaches the API server as a cluster admin.
	Config *rest.Config
	// Kubeconfig is a file with the same credentials, for child processes.
	Kubeconfig string
	// Dir holds the control plane's files and logs.
	Dir string
	// Bin is the directory of the upstream binaries.
	Bin string

	mu     sync.Mutex
	procs  []*proc
	tokens map[string]string // Options.Users' bearer tokens by user name
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited
	err  error         // valid after done
}

// Options tune Start.
type Options struct {
	// Dir is where state and logs go; a new temporary directory if empty.
	Dir string
	// ExtraAPIServerArgs are appended to the API server's command line.
	ExtraAPIServerArgs []string
	// Namespace is written as the kubeconfig context's namespace.
	Namespace string

	// ServiceAccounts turns on the ServiceAccount admission plugin and runs
	// kube-controller-manager's serviceaccount controller, which gives every
	// namespace its "default" ServiceAccount as in a real cluster. Pods then
	// get the projected token volume a real cluster adds, which KubeVirt
	// counts when it matches attachment pods. Off by default: without the
	// controller, admission would refuse pods in namespaces the tests create.
	ServiceAccounts bool
	// Aggregation configures the API server as an aggregator (front-proxy CA,
	// proxy client certificate, request-header flags), so APIServices backed
	// by extension servers such as KubeVirt's virt-api can be served.
	Aggregation bool
	// Users are extra token-file identities; UserConfig and UserKubeconfig
	// reach the API server as them.
	Users []User
}

// BinDir finds the upstream binaries: $HCSI_TOOLS_BIN if set, otherwise it
// runs hack/tools.sh, which builds them on the first run and caches them.
func BinDir() (string, error) {
	if d := os.Getenv("HCSI_TOOLS_BIN"); d != "" {
		return d, nil
	}
	root, err := checkout.Root()
	if err != nil {
		return "", err
	}
	var stderr bytes.Buffer
	cmd := exec.Command("bash", filepath.Join(root, "hack", "tools.sh"))
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/tools.sh: %v: %s", err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}

// Start runs etcd and kube-apiserver and waits until the API server is ready.
func Start(ctx context.Context, opts Options) (*Env, error) {
	bin, err := BinDir()
	if err != nil {
		return nil, err
	}
	dir := opts.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "hcsi-env-"); err != nil {
			return nil, err
		}
	}
	e := &Env{Dir: dir, Bin: bin}
	if err := e.start(ctx, opts); err != nil {
		e.Stop()
		return nil, err
	}
	return e, nil
}

func (e *Env) start(ctx context.Context, opts Options) error {
	etcdClient, etcdPeer, apiPort, err := freePorts3()
	if err != nil {
		return err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	if err := e.run("etcd",
		"--data-dir="+filepath.Join(e.Dir, "etcd"),
		"--listen-client-urls="+etcdURL,
		"--advertise-client-urls="+etcdURL,
		fmt.Sprintf("--listen-peer-urls=http://127.0.0.1:%d", etcdPeer),
		"--unsafe-no-fsync=true",
		"--log-level=warn",
	); err != nil {
		return err
	}

	token, err := randomHex(16)
	if err != nil {
		return err
	}
	tokenFile, err := e.tokenFile(token, opts.Users)
	if err != nil {
		return err
	}
	saKey := filepath.Join(e.Dir, "sa.key")
	if err := writeRSAKey(saKey); err != nil {
		return err
	}
	args := []string{
		"--etcd-servers=" + etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		fmt.Sprintf("--secure-port=%d", apiPort),
		"--cert-dir=" + filepath.Join(e.Dir, "certs"),
		"--token-auth-file=" + tokenFile,
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saKey,
		"--service-account-signing-key-file=" + saKey,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--allow-privileged=true",
		"--enable-priority-and-fairness=false",
	}
	if !opts.ServiceAccounts {
		args = append(args, "--disable-admission-plugins=ServiceAccount")
	}
	if opts.Aggregation {
		agg, err := e.aggregationArgs()
		if err != nil {
			return err
		}
		args = append(args, agg...)
	}
	if err := e.run("kube-apiserver", append(args, opts.ExtraAPIServerArgs...)...); err != nil {
		return err
	}

	host := fmt.Sprintf("https://127.0.0.1:%d", apiPort)
	e.Config = &rest.Config{
		Host:            host,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true},
		QPS:             200,
		Burst:           400,
	}
	e.Kubeconfig = filepath.Join(e.Dir, "kubeconfig")
	if err := WriteKubeconfig(e.Kubeconfig, e.Config, opts.Namespace); err != nil {
		return err
	}
	if err := e.waitReady(ctx, host, token); err != nil {
		return err
	}
	if opts.ServiceAccounts {
		return e.runServiceAccountController()
	}
	return nil
}

// runServiceAccountController runs only the controller that creates each
// namespace's "default" ServiceAccount (kubernetes v1.35.4
// pkg/controller/serviceaccount/serviceaccounts_controller.go), the real one
// rather than a stand-in, so the timing of a new namespace's first pod is a
// real cluster's, and the garbage collector: KubeVirt leaves an attachment
// pod whose virt-launcher pod (its owner) is gone to it, so without it a
// stopped VM's attachment pods would run on.
func (e *Env) runServiceAccountController() error {
	return e.run("kube-controller-manager",
		"--kubeconfig="+e.Kubeconfig,
		"--controllers=serviceaccount,garbagecollector",
		"--use-service-account-credentials=false",
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=0",
	)
}

// WriteKubeconfig writes cfg (token auth) as a kubeconfig file whose current
// context has the given namespace.
func WriteKubeconfig(path string, cfg *rest.Config, namespace string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["env"] = &clientcmdapi.Cluster{Server: cfg.Host, InsecureSkipTLSVerify: cfg.Insecure}
	kc.AuthInfos["env"] = &clientcmdapi.AuthInfo{Token: cfg.BearerToken}
	kc.Contexts["env"] = &clientcmdapi.Context{Cluster: "env", AuthInfo: "env", Namespace: namespace}
	kc.CurrentContext = "env"
	return clientcmd.WriteToFile(*kc, path)
}

func (e *Env) waitReady(ctx context.Context, host, token string) error {
	client := &http.Client{Transport: &http.Transport{TLSClientConfig: insecureTLS()}, Timeout: 2 * time.Second}
	ready, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	err := testwait.Poll(ready, "kube-apiserver's /readyz", func() (bool, string, error) {
		if err := e.exited(); err != nil {
			return false, "", err
		}
		req, _ := http.NewRequestWithContext(ready, http.MethodGet, host+"/readyz", nil)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := client.Do(req)
		if err != nil {
			return false, err.Error(), nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status, nil
	})
	if err != nil {
		return fmt.Errorf("%w; logs in %s", err, e.Dir)
	}
	return nil
}

// Run starts one of the upstream binaries with its output in Dir/<name>.log;
// Stop ends it.
func (e *Env) Run(name string, args ...string) error { return e.run(name, args...) }

func (e *Env) run(name string, args ...string) error {
	logf, err := os.Create(filepath.Join(e.Dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(e.Bin, name), args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// A test binary killed before its cleanups run (a timeout, a closed
	// pipe) must not leave API servers behind on a shared machine.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logf.Close()
		close(p.done)
	}()
	e.mu.Lock()
	e.procs = append(e.procs, p)
	e.mu.Unlock()
	return nil
}

// Exited reports the first started process that has exited, with where its
// log is; nil while all of them run.
func (e *Env) Exited() error { return e.exited() }

func (e *Env) exited() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, p := range e.procs {
		select {
		case <-p.done:
			return fmt.Errorf("%s exited: %v (see %s)", p.name, p.err, filepath.Join(e.Dir, p.name+".log"))
		default:
		}
	}
	return nil
}

// Stop ends every process in reverse start order and removes Dir unless
// HCSI_KEEP_ENV is set.
func (e *Env) Stop() {
	e.mu.Lock()
	procs := e.procs
	e.procs = nil
	e.mu.Unlock()
	for i := len(procs) - 1; i >= 0; i-- {
		p := procs[i]
		_ = p.cmd.Process.Signal(os.Interrupt)
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	}
	if os.Getenv("HCSI_KEEP_ENV") == "" && e.Dir != "" {
		_ = os.RemoveAll(e.Dir)
	}
}

func freePorts3() (a, b, c int, err error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	ports := make([]int, 3)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, 0, 0, err
		}
		ls = append(ls, l)
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports[0], ports[1], ports[2], nil
}

func randomHex(n int) (string, error) {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

func writeRSAKey(path string) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	der := x509.MarshalPKCS1PrivateKey(key)
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: der}), 0o600)
}

func insecureTLS() *tls.Config { return &tls.Config{InsecureSkipVerify: true} } //nolint:gosec // loopback test server with a self-signed cert
