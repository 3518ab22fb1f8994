// Package realkubevirt runs KubeVirt's own virt-controller and virt-api,
// built from source by hack/tools.sh, against a testenv API server, so the
// host's VM and VMI state machines, webhooks and hotplug subresource API are
// KubeVirt's and not a re-implementation. Only the node agents are played
// here: the host nodes' kubelets for virt-launcher and attachment pods, and
// virt-handler's VMI status writes (node.go).
//
// The environment must be started with EnvOptions, which switch on what
// KubeVirt needs from the API server (ServiceAccount admission, aggregation,
// KubeVirt's service-account identities).
package realkubevirt

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/virthandler"
)

// Namespace is where KubeVirt's components live; virt-controller and virt-api
// fall back to it when no in-pod service-account namespace file exists.
const Namespace = "kubevirt"

// KubeVirt's service accounts (v1.7.0
// pkg/virt-operator/resource/generate/components/serviceaccountnames.go).
// The VMI update admitter lets only these change a VMI's spec, so each
// process runs under its own.
var (
	ControllerUser = testenv.ServiceAccountUser(Namespace, "kubevirt-controller")
	APIServerUser  = testenv.ServiceAccountUser(Namespace, "kubevirt-apiserver")
	HandlerUser    = testenv.ServiceAccountUser(Namespace, "kubevirt-handler")
)

// ErrNotBuilt says the binaries of a version are not in the tools directory.
var ErrNotBuilt = errors.New("KubeVirt binaries not built (hack/tools.sh builds them)")

// Mode is the hotplug API a KubeVirt CR's feature gates switch on.
type Mode string

const (
	// Legacy is the addvolume/removevolume subresource API (HotplugVolumes).
	Legacy Mode = "legacy"
	// Declarative is hotplug by editing the VM's volumes
	// (DeclarativeHotplugVolumes).
	Declarative Mode = "declarative"
)

// FeatureGates are the KubeVirt CR's gates as Harvester's chart sets them
// (harvester deploy/charts/harvester/values.yaml: v1.6.0 to v1.7.x for
// Legacy, v1.8.0 and v1.8.2 for Declarative). If both hotplug gates were on,
// the legacy path would win, so each mode carries only its own.
func FeatureGates(m Mode) ([]string, error) {
	switch m {
	case Legacy:
		return []string{"LiveMigration", "HotplugVolumes", "HostDevices", "GPU", "CPUManager", "VMPersistentState", "VMLiveUpdateFeatures", "ExpandDisks"}, nil
	case Declarative:
		return []string{"CPUManager", "DeclarativeHotplugVolumes", "ExpandDisks", "EnableVirtioFsConfigVolumes", "HostDevices"}, nil
	}
	return nil, fmt.Errorf("unknown hotplug mode %q", m)
}

// Options tune Start.
type Options struct {
	// Mode picks the KubeVirt CR's feature gates.
	Mode Mode
	// Nodes are the host nodes virt-launcher pods are bound to, round robin;
	// missing ones are created. One node "kubevirt-node-0" if empty.
	Nodes []string
	// Disks, when set, follow each hot-plugged volume into and out of its
	// VM as virt-handler plugs and unplugs it.
	Disks DiskHook
	// Release is the KubeVirt release whose virt-handler the node agents
	// play (internal/virthandler ForVersion): the control plane's tag when
	// empty; a Harvester release that runs a later patch of the tag (1.7.4
	// on v1.7.0, say) names its own.
	Release string
	// Scale multiplies virt-handler's stage latencies
	// (virthandler.DefaultTimings; 0 means 1); Jitter spreads each over
	// ±Jitter of its value with a generator seeded by Seed.
	Scale  float64
	Jitter float64
	Seed   uint64
	// Kubelets says real kubelets run the host nodes (they register the
	// Nodes) and a real scheduler places KubeVirt's pods: the kubelet
	// stand-in then leaves pods alone and no Node is created here.
	Kubelets bool
	// Launchers ends a source virt-launcher pod's containers after its
	// migration; needed with Kubelets, whose containers only the host can
	// end (migration.go).
	Launchers LauncherExit
}

// ControlPlane is KubeVirt's control plane running on an Env. Its processes
// belong to the Env, which ends them; Stop ends the node agents.
type ControlPlane struct {
	Version string
	// KubeVirt reaches the API server as the admin.
	KubeVirt kubevirt.Interface

	handler *virthandler.Handler
	requeue func(namespace, name string)
	passes  func(namespace, name string) int
	hold    func(namespace, name string, on bool)
	cancel  context.CancelFunc
	done    chan struct{}
}

// EnvOptions adds what KubeVirt needs to opts: ServiceAccount admission with
// each namespace's default ServiceAccount, aggregation, and KubeVirt's
// service-account identities.
func EnvOptions(opts testenv.Options) testenv.Options {
	opts.ServiceAccounts = true
	opts.Aggregation = true
	opts.Users = append(opts.Users, ControllerUser, APIServerUser, HandlerUser)
	return opts
}

// Binaries are the names hack/tools.sh gives a version's binaries.
func Binaries(version string) (controller, api, manifests string) {
	return "virt-controller-" + version, "virt-api-" + version, "kubevirt-manifests-" + version
}

// Built reports whether bin holds every binary of version.
func Built(bin, version string) bool {
	c, a, m := Binaries(version)
	for _, n := range []string{c, a, m} {
		if _, err := os.Stat(filepath.Join(bin, n)); err != nil {
			return false
		}
	}
	return true
}

// Start installs KubeVirt version's CRDs, RBAC, webhooks and APIServices on
// env, creates the KubeVirt CR with the mode's gates, runs virt-api and
// virt-controller under their service accounts and the node agents, and
// returns once the subresource API is available and virt-controller leads.
func Start(ctx context.Context, env *testenv.Env, version string, opts Options) (*ControlPlane, error) {
	if !Built(env.Bin, version) {
		return nil, fmt.Errorf("%w: %s in %s", ErrNotBuilt, version, env.Bin)
	}
	gates, err := FeatureGates(opts.Mode)
	if err != nil {
		return nil, err
	}
	if len(opts.Nodes) == 0 {
		opts.Nodes = []string{"kubevirt-node-0"}
	}
	kube, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		return nil, err
	}
	kv, err := kubevirt.NewForConfig(env.Config)
	if err != nil {
		return nil, err
	}
	s := &starter{env: env, version: version, kube: kube, kv: kv}
	apiPort, ctlPort, err := freePorts()
	if err != nil {
		return nil, err
	}
	steps := []func(context.Context) error{
		func(ctx context.Context) error { return s.ensureNamespace(ctx, Namespace) },
		func(ctx context.Context) error {
			if opts.Kubelets {
				return nil
			}
			return s.ensureNodes(ctx, opts.Nodes)
		},
		func(ctx context.Context) error { return s.certificates(ctx) },
		func(ctx context.Context) error { return s.applyManifests(ctx, apiPort) },
		func(ctx context.Context) error { return s.kubeVirtCR(ctx, gates) },
		func(ctx context.Context) error { return s.runAPI(ctx, apiPort) },
		func(ctx context.Context) error { return s.runController(ctx, ctlPort) },
	}
	for _, step := range steps {
		if err := step(ctx); err != nil {
			return nil, err
		}
	}
	handlerCfg, err := env.UserConfig(HandlerUser.Name)
	if err != nil {
		return nil, err
	}
	handlerKV, err := kubevirt.NewForConfig(handlerCfg)
	if err != nil {
		return nil, err
	}
	agentCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	handler, err := newHandler(version, opts)
	if err != nil {
		cancel()
		return nil, err
	}
	cp := &ControlPlane{Version: version, KubeVirt: kv, handler: handler, cancel: cancel, done: make(chan struct{})}
	agents := newNodeAgents(kube, kv, handlerKV, opts.Nodes, handler)
	agents.kubelets, agents.launchers = opts.Kubelets, opts.Launchers
	agents.pausedConditionFixed = pausedConditionFixed(version)
	if opts.Scale > 0 {
		agents.transferTime = time.Duration(float64(migrationTransfer) * opts.Scale)
	}
	cp.requeue, cp.passes, cp.hold = agents.requeueVMI, agents.passCount, agents.hold
	go func() {
		defer close(cp.done)
		agents.run(agentCtx)
	}()
	if err := s.waitReady(ctx); err != nil {
		cp.Stop()
		return nil, err
	}
	klog.InfoS("KubeVirt control plane ready", "version", version, "mode", opts.Mode)
	return cp, nil
}

// newHandler is the node agents' virt-handler: the release's behaviours and
// its stage latencies, scaled and jittered.
func newHandler(version string, opts Options) (*virthandler.Handler, error) {
	release := opts.Release
	if release == "" {
		release = version
	}
	rel, err := virthandler.ForVersion(release)
	if err != nil {
		return nil, err
	}
	if opts.Jitter < 0 || opts.Jitter >= 1 {
		return nil, fmt.Errorf("realkubevirt: jitter %v out of [0,1)", opts.Jitter)
	}
	scale := opts.Scale
	if scale <= 0 {
		scale = 1
	}
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(opts.Seed, opts.Seed^0x9e3779b97f4a7c15))
	jitter := func(d time.Duration) time.Duration {
		if opts.Jitter == 0 || d <= 0 {
			return d
		}
		mu.Lock()
		defer mu.Unlock()
		return time.Duration(float64(d) * (1 + opts.Jitter*(2*r.Float64()-1)))
	}
	return virthandler.New(rel, virthandler.DefaultTimings().Scaled(scale), jitter, opts.Disks, klog.Background().WithName("virt-handler")), nil
}

// Faults are the host faults the node agents' virt-handler meets; after a
// change, Requeue has it look at the VM's VMI at once.
func (c *ControlPlane) Faults() *virthandler.Faults { return c.handler.Faults() }

// Requeue has virt-handler look at the VMI again now.
func (c *ControlPlane) Requeue(namespace, name string) { c.requeue(namespace, name) }

// Passes is how many hotplug passes virt-handler made over the VMI, for
// tests that show a state holding while virt-handler keeps looking.
func (c *ControlPlane) Passes(namespace, name string) int { return c.passes(namespace, name) }

// Stop ends the node agents; the Env's Stop ends virt-api and virt-controller.
func (c *ControlPlane) Stop() {
	c.cancel()
	<-c.done
}

type starter struct {
	env     *testenv.Env
	version string
	kube    kubernetes.Interface
	kv      kubevirt.Interface
	ca      *testenv.CA
	certDir string
}

func (s *starter) ensureNamespace(ctx context.Context, name string) error {
	_, err := s.kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil
	}
	return err
}

// ensureNodes creates the host nodes KubeVirt schedules onto, labelled
// schedulable as virt-handler labels them.
func (s *starter) ensureNodes(ctx context.Context, names []string) error {
	for _, n := range names {
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n, Labels: map[string]string{
			"kubernetes.io/hostname":   n,
			kubevirtv1.NodeSchedulable: "true",
		}}}
		if _, err := s.kube.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("node %s: %w", n, err)
		}
	}
	return nil
}

// certificates writes virt-api's serving certificate, valid for the names
// the aggregator (virt-api.kubevirt.svc) and the webhooks (127.0.0.1) use,
// and publishes its CA as the kubevirt-ca ConfigMap virt-api reads.
func (s *starter) certificates(ctx context.Context) error {
	ca, err := testenv.NewCA("kubevirt.io")
	if err != nil {
		return err
	}
	s.ca = ca
	s.certDir = filepath.Join(s.env.Dir, "kubevirt-certs")
	if err := os.MkdirAll(s.certDir, 0o700); err != nil {
		return err
	}
	hosts := []string{"virt-api." + Namespace + ".svc", "virt-api." + Namespace + ".svc.cluster.local", "localhost", "127.0.0.1"}
	cert, key, err := ca.Issue("virt-api."+Namespace+".svc", hosts, x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth)
	if err != nil {
		return err
	}
	for name, b := range map[string][]byte{"tls.crt": cert, "tls.key": key} {
		if err := os.WriteFile(filepath.Join(s.certDir, name), b, 0o600); err != nil {
			return err
		}
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "kubevirt-ca", Namespace: Namespace},
		Data:       map[string]string{"ca-bundle": string(ca.CertPEM)},
	}
	if _, err := s.kube.CoreV1().ConfigMaps(Namespace).Create(ctx, cm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	// The aggregator resolves an ExternalName service to its external name
	// and the APIService's port: no kube-proxy or endpoints are needed.
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "virt-api", Namespace: Namespace},
		Spec:       corev1.ServiceSpec{Type: corev1.ServiceTypeExternalName, ExternalName: "localhost"},
	}
	if _, err := s.kube.CoreV1().Services(Namespace).Create(ctx, svc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// applyManifests creates what the version's generator writes, CRDs first
// (and Established) and webhooks before anything else can create a VM: a VMI
// created without the mutating webhook lacks the defaults virt-api's update
// admitter later dereferences.
func (s *starter) applyManifests(ctx context.Context, apiPort int) error {
	_, _, gen := Binaries(s.version)
	var stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, filepath.Join(s.env.Bin, gen))
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", gen, err, stderr.String())
	}
	objs, err := decodeAll(out)
	if err != nil {
		return fmt.Errorf("%s output: %w", gen, err)
	}
	dyn, err := dynamic.NewForConfig(s.env.Config)
	if err != nil {
		return err
	}
	var crds, rest []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == "CustomResourceDefinition" {
			crds = append(crds, o)
			continue
		}
		if err := s.pointAtLocalAPI(o, apiPort); err != nil {
			return err
		}
		rest = append(rest, o)
	}
	crdRes := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	for _, c := range crds {
		if err := create(ctx, dyn.Resource(crdRes), c); err != nil {
			return err
		}
	}
	for _, c := range crds {
		if err := waitEstablished(ctx, dyn.Resource(crdRes), c.GetName()); err != nil {
			return err
		}
	}
	disco, err := discovery.NewDiscoveryClientForConfig(s.env.Config)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disco))
	for _, o := range rest {
		m, err := mapper.RESTMapping(o.GroupVersionKind().GroupKind(), o.GroupVersionKind().Version)
		if err != nil {
			return fmt.Errorf("%s %s: %w", o.GetKind(), o.GetName(), err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = dyn.Resource(m.Resource).Namespace(o.GetNamespace())
		}
		if err := create(ctx, ri, o); err != nil {
			return err
		}
	}
	return nil
}

// pointAtLocalAPI routes webhooks to virt-api's local port by URL and gives
// webhooks and APIServices the CA that signed virt-api's certificate; the
// operator would inject the CA and use the in-cluster service.
func (s *starter) pointAtLocalAPI(o *unstructured.Unstructured, apiPort int) error {
	caBundle := base64.StdEncoding.EncodeToString(s.ca.CertPEM)
	switch o.GetKind() {
	case "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration":
		hooks, _, err := unstructured.NestedSlice(o.Object, "webhooks")
		if err != nil {
			return err
		}
		for i, h := range hooks {
			hm := h.(map[string]any)
			path, _, _ := unstructured.NestedString(hm, "clientConfig", "service", "path")
			hm["clientConfig"] = map[string]any{
				"url":      fmt.Sprintf("https://127.0.0.1:%d%s", apiPort, path),
				"caBundle": caBundle,
			}
			hooks[i] = hm
		}
		return unstructured.SetNestedSlice(o.Object, hooks, "webhooks")
	case "APIService":
		if err := unstructured.SetNestedField(o.Object, caBundle, "spec", "caBundle"); err != nil {
			return err
		}
		return unstructured.SetNestedField(o.Object, int64(apiPort), "spec", "service", "port")
	}
	return nil
}

// kubeVirtCR creates the KubeVirt CR with the gates and sets its phase:
// virt-controller and virt-api use a KubeVirt CR's configuration only once
// its status has a phase (v1.7.0 pkg/virt-config/configuration.go:357),
// and default a VMI's architecture to the status's (configuration.go:311),
// both of which the operator would write.
func (s *starter) kubeVirtCR(ctx context.Context, gates []string) error {
	rollout := kubevirtv1.VMRolloutStrategyLiveUpdate
	kv := &kubevirtv1.KubeVirt{
		ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: Namespace},
		Spec: kubevirtv1.KubeVirtSpec{Configuration: kubevirtv1.KubeVirtConfiguration{
			DeveloperConfiguration: &kubevirtv1.DeveloperConfiguration{FeatureGates: gates},
			VMRolloutStrategy:      &rollout,
		}},
	}
	created, err := s.kv.KubevirtV1().KubeVirts(Namespace).Create(ctx, kv, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("KubeVirt CR: %w", err)
	}
	created.Status.Phase = kubevirtv1.KubeVirtPhaseDeployed
	// The operator records the default architecture in the status; VMIs
	// take it from there and are refused without one.
	created.Status.DefaultArchitecture = runtime.GOARCH
	created.Status.ObservedKubeVirtVersion = s.version
	if _, err := s.kv.KubevirtV1().KubeVirts(Namespace).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("KubeVirt CR status: %w", err)
	}
	return nil
}

func (s *starter) runAPI(_ context.Context, port int) error {
	kc, err := s.env.UserKubeconfig(APIServerUser.Name, Namespace)
	if err != nil {
		return err
	}
	_, api, _ := Binaries(s.version)
	crt, key := filepath.Join(s.certDir, "tls.crt"), filepath.Join(s.certDir, "tls.key")
	return s.env.Run(api,
		"--kubeconfig="+kc,
		"--listen=127.0.0.1",
		"--port="+strconv.Itoa(port),
		"--tls-cert-file="+crt, "--tls-key-file="+key,
		"--handler-cert-file="+crt, "--handler-key-file="+key,
	)
}

func (s *starter) runController(_ context.Context, port int) error {
	kc, err := s.env.UserKubeconfig(ControllerUser.Name, Namespace)
	if err != nil {
		return err
	}
	ctl, _, _ := Binaries(s.version)
	return s.env.Run(ctl,
		"--kubeconfig="+kc,
		"--listen=127.0.0.1",
		"--port="+strconv.Itoa(port),
		// No image is pulled: the node agents play the launcher.
		"--launcher-image=virt-launcher:"+s.version,
	)
}

// waitReady waits for the aggregated subresource API to be available (virt-api
// serves) and for virt-controller to hold its leader lease (it reconciles).
func (s *starter) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	dyn, err := dynamic.NewForConfig(s.env.Config)
	if err != nil {
		return err
	}
	apiSvc := schema.GroupVersionResource{Group: "apiregistration.k8s.io", Version: "v1", Resource: "apiservices"}
	var last string
	for {
		if err := s.env.Exited(); err != nil {
			return err
		}
		ready, state := s.readyState(ctx, dyn.Resource(apiSvc))
		if ready {
			return nil
		}
		last = state
		select {
		case <-ctx.Done():
			return fmt.Errorf("KubeVirt %s not ready: %s (logs in %s)", s.version, last, s.env.Dir)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (s *starter) readyState(ctx context.Context, apiServices dynamic.ResourceInterface) (bool, string) {
	for _, v := range kubevirtv1.SubresourceGroupVersions {
		name := v.Version + "." + v.Group
		o, err := apiServices.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		conds, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
		if !conditionTrue(conds, "Available") {
			return false, fmt.Sprintf("APIService %s not Available: %v", name, conds)
		}
	}
	lease, err := s.kube.CoordinationV1().Leases(Namespace).Get(ctx, "virt-controller", metav1.GetOptions{})
	if err != nil {
		return false, "virt-controller lease: " + err.Error()
	}
	if lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity == "" {
		return false, "virt-controller lease has no holder"
	}
	return true, ""
}

func conditionTrue(conds []any, typ string) bool {
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == typ && m["status"] == "True" {
			return true
		}
	}
	return false
}

func decodeAll(b []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(b), 4096)
	var out []*unstructured.Unstructured
	for {
		o := &unstructured.Unstructured{}
		if err := dec.Decode(&o.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, err
		}
		if len(o.Object) == 0 {
			continue
		}
		out = append(out, o)
	}
}

func create(ctx context.Context, ri dynamic.ResourceInterface, o *unstructured.Unstructured) error {
	if _, err := ri.Create(ctx, o, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create %s %s: %w", o.GetKind(), o.GetName(), err)
	}
	return nil
}

func waitEstablished(ctx context.Context, ri dynamic.ResourceInterface, name string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	for {
		o, err := ri.Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			conds, _, _ := unstructured.NestedSlice(o.Object, "status", "conditions")
			if conditionTrue(conds, "Established") {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("CRD %s not established: %v", name, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func freePorts() (a, b int, err error) {
	var ports [2]int
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, 0, err
		}
		defer l.Close()
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports[0], ports[1], nil
}
