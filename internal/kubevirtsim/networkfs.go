package kubevirtsim

import (
	"context"
	"sync"
	"time"

	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
)

// Harvester's networkfs-manager API: NetworkFilesystems live in
// harvester-system, named after the Longhorn volume (the host PV) they
// export. The CRD below carries the field names, types, enums, defaults and
// required lists of networkfs-manager's CRD (harvesterhci.io, v1beta1).
var networkFSGVR = schema.GroupVersionResource{Group: "harvesterhci.io", Version: "v1beta1", Resource: "networkfilesystems"}

// NetworkFSNamespace is where NetworkFilesystems live.
const NetworkFSNamespace = "harvester-system"

// DefaultNFSEndpoint is the address the simulator reports for an enabled
// export unless Options.NFSEndpoint says otherwise.
const DefaultNFSEndpoint = "10.53.0.10"

func networkFSCRD() *apiextv1.CustomResourceDefinition {
	str := func(desc string) apiextv1.JSONSchemaProps {
		return apiextv1.JSONSchemaProps{Type: "string", Description: desc}
	}
	enum := func(def string, values ...string) apiextv1.JSONSchemaProps {
		p := apiextv1.JSONSchemaProps{Type: "string", Default: &apiextv1.JSON{Raw: []byte(`"` + def + `"`)}}
		for _, v := range values {
			p.Enum = append(p.Enum, apiextv1.JSON{Raw: []byte(`"` + v + `"`)})
		}
		return p
	}
	condition := apiextv1.JSONSchemaProps{Type: "object", Required: []string{"lastTransitionTime", "status", "type"},
		Properties: map[string]apiextv1.JSONSchemaProps{
			"lastTransitionTime": {Type: "string", Format: "date-time"},
			"message":            {Type: "string"}, "reason": {Type: "string"}, "status": {Type: "string"}, "type": {Type: "string"},
		}}
	endpoint := str("the current Endpoint of the networkFS")
	endpoint.Default = &apiextv1.JSON{Raw: []byte(`""`)}
	schemaProps := &apiextv1.JSONSchemaProps{
		Type:     "object",
		Required: []string{"spec"},
		Properties: map[string]apiextv1.JSONSchemaProps{
			"apiVersion": {Type: "string"}, "kind": {Type: "string"}, "metadata": {Type: "object"},
			"spec": {Type: "object", Required: []string{"desiredState", "networkFSName"}, Properties: map[string]apiextv1.JSONSchemaProps{
				"desiredState":   str(`desired state of the networkFS endpoint: "Disabled", "Enabled", "Expand" or "Unknown"`),
				"networkFSName":  str("name of the networkFS to which the endpoint is exported"),
				"perferredNodes": str("preferred nodes to which the networkFS endpoint is exported (sic)"),
				"provisioner":    str("the provider of this networkfilesystem"),
			}},
			"status": {Type: "object", Required: []string{"endpoint", "state", "status", "type"}, Properties: map[string]apiextv1.JSONSchemaProps{
				"conditions": {Type: "array", Default: &apiextv1.JSON{Raw: []byte(`[]`)}, Items: &apiextv1.JSONSchemaPropsOrArray{Schema: &condition}},
				"endpoint":   endpoint,
				"mountOpts":  str("the recommended mount options for the networkFS endpoint"),
				"state":      enum("Disabled", "Enabled", "Enabling", "Disabling", "Disabled", "Unknown"),
				"status":     enum("NotReady", "Ready", "NotReady", "Reconciling", "Expanding", "Unknown"),
				"type":       enum("NFS", "NFS", "Unknown"),
			}},
		},
	}
	c := crdDef("harvesterhci.io", "v1beta1", "networkfilesystems", "networkfilesystem", "NetworkFilesystem", true, []string{"netfilesystem", "netfilesystems"}, schemaProps)
	c.Spec.Versions[0].AdditionalPrinterColumns = []apiextv1.CustomResourceColumnDefinition{
		{Name: "DesiredState", Type: "string", JSONPath: ".spec.desiredState"},
		{Name: "Endpoint", Type: "string", JSONPath: ".status.endpoint"},
		{Name: "EndpointStatus", Type: "string", JSONPath: ".status.status"},
		{Name: "State", Type: "string", JSONPath: ".status.state"},
		{Name: "Type", Type: "string", JSONPath: ".status.type"},
	}
	return c
}

// networkFSManager plays Harvester's networkfs-manager: it initialises a new
// NetworkFilesystem's status (Disabled), and moves it Disabled → Enabling →
// Enabled (with an endpoint, after Timings.NetworkFS) when desiredState is
// Enabled, and Enabled → Disabling → Disabled (endpoint cleared, after the
// same delay) when it is Disabled. Like the real one it exports only a
// volume that exists: while the PV it is named after is missing it stays
// Enabling. A simulator scoped to a namespace handles only the exports of
// PVs whose claim is in that namespace.
type networkFSManager struct {
	c     *cluster
	queue workQueue
	inf   cache.SharedIndexInformer

	mu  sync.Mutex
	due deadlines // per object UID and target state
}

func newNetworkFSManager(c *cluster) *networkFSManager {
	m := &networkFSManager{c: c, queue: newWorkQueue("networkfs", c.t.BackoffBase, c.t.HandlerPoll), due: deadlines{}}
	m.inf = dynamicinformer.NewFilteredDynamicInformer(c.dyn, networkFSGVR, NetworkFSNamespace, 0,
		cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc}, nil).Informer()
	return m
}

func (m *networkFSManager) register() {
	_, _ = m.inf.AddEventHandler(onEvent(func(obj any) {
		if k := objectKey(obj); k != "" {
			m.queue.Add(k)
		}
	}))
	// A PV that appears may let an export that waits for it go on.
	_, _ = m.c.pvcInf.AddEventHandler(onEvent(func(any) {
		for _, k := range m.inf.GetStore().ListKeys() {
			m.queue.Add(k)
		}
	}))
}

func (m *networkFSManager) run(ctx context.Context) {
	m.c.goRun(func() { m.inf.RunWithContext(ctx) })
	m.c.goRun(func() {
		if cache.WaitForCacheSync(ctx.Done(), m.inf.HasSynced) {
			m.queue.run(ctx, m.c, 2, m.sync)
		}
	})
}

func (m *networkFSManager) shutdown() { m.queue.ShutDown() }

// ours reports whether this simulator serves the export of PV name.
func (m *networkFSManager) ours(ctx context.Context, name string) (exists, ours bool, err error) {
	pv, err := m.c.kube.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return false, m.c.opts.Namespace == "", nil
	case err != nil:
		return false, false, err
	}
	if m.c.opts.Namespace == "" {
		return true, true, nil
	}
	return true, pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == m.c.opts.Namespace, nil
}

func (m *networkFSManager) sync(ctx context.Context, key string) (time.Duration, error) {
	obj, ok, err := m.inf.GetStore().GetByKey(key)
	if err != nil || !ok {
		return 0, err
	}
	u := obj.(*unstructured.Unstructured)
	if u.GetDeletionTimestamp() != nil {
		return 0, nil
	}
	exists, ours, err := m.ours(ctx, u.GetName())
	if err != nil || !ours {
		return 0, err
	}
	desired, _, _ := unstructured.NestedString(u.Object, "spec", "desiredState")
	state, _, _ := unstructured.NestedString(u.Object, "status", "state")
	next := map[string]any{}
	switch {
	case state == "":
		next = map[string]any{"state": "Disabled", "status": "Unknown", "type": "NFS", "endpoint": ""}
	case desired == "Enabled" && (state == "Disabled" || state == "Disabling"):
		next = map[string]any{"state": "Enabling", "status": "NotReady", "type": "NFS", "endpoint": ""}
	case desired == "Enabled" && state == "Enabling":
		if !exists {
			return m.c.t.HandlerPoll, nil // no Longhorn volume to share yet
		}
		if wait := m.wait(u.GetUID(), "Enabled"); wait > 0 {
			return wait, nil
		}
		endpoint := m.c.opts.NFSEndpoint
		if endpoint == "" {
			endpoint = DefaultNFSEndpoint
		}
		next = map[string]any{"state": "Enabled", "status": "Ready", "type": "NFS", "endpoint": endpoint, "mountOpts": m.c.opts.NFSMountOptions}
	case desired == "Disabled" && (state == "Enabled" || state == "Enabling"):
		next = map[string]any{"state": "Disabling", "status": "NotReady", "type": "NFS", "endpoint": ""}
	case desired == "Disabled" && state == "Disabling":
		if wait := m.wait(u.GetUID(), "Disabled"); wait > 0 {
			return wait, nil
		}
		next = map[string]any{"state": "Disabled", "status": "NotReady", "type": "NFS", "endpoint": ""}
	default:
		return 0, nil // in the desired state, or a state it does not handle (Expand, Unknown)
	}
	cur, err := m.c.dyn.Resource(networkFSGVR).Namespace(NetworkFSNamespace).Get(ctx, u.GetName(), metav1.GetOptions{})
	if err != nil {
		return 0, client404(err)
	}
	status, _, _ := unstructured.NestedMap(cur.Object, "status")
	if status == nil {
		status = map[string]any{}
	}
	for k, v := range next {
		status[k] = v
	}
	if next["mountOpts"] == "" {
		delete(status, "mountOpts")
	}
	if err := unstructured.SetNestedMap(cur.Object, status, "status"); err != nil {
		return 0, err
	}
	if _, err := m.c.dyn.Resource(networkFSGVR).Namespace(NetworkFSNamespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		return 0, client404(err)
	}
	m.mu.Lock()
	delete(m.due, string(u.GetUID())+"/Enabled")
	delete(m.due, string(u.GetUID())+"/Disabled")
	m.mu.Unlock()
	m.c.log.V(2).Info("NetworkFilesystem status", "name", u.GetName(), "desired", desired, "state", next["state"], "endpoint", next["endpoint"])
	return 0, nil
}

// wait returns how long until the export of uid may reach state.
func (m *networkFSManager) wait(uid types.UID, state string) time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := string(uid) + "/" + state
	now := time.Now()
	at := m.due.at(k, now, m.c.t.NetworkFS, m.c.jit)
	if now.Before(at) {
		return at.Sub(now)
	}
	delete(m.due, k)
	return 0
}

// client404 drops NotFound: the object went away, nothing to do.
func client404(err error) error {
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// NetworkFilesystemsCRD is the simulator's copy of networkfs-manager's CRD,
// for tests that install it elsewhere (or check its schema).
func NetworkFilesystemsCRD() *apiextv1.CustomResourceDefinition { return networkFSCRD() }
