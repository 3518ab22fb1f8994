// Package host is the driver's access to the host (Harvester) cluster: the
// kubeconfig and namespace, VM and VMI informers, host PVCs, and the two
// hotplug backends (declarative VM patches and the addvolume/removevolume
// subresources) with the classification of KubeVirt's answers.
package host

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"
)

// DefaultKubeconfig is where upstream looks when --kubeconfig is not given
// or names a file that does not exist.
const DefaultKubeconfig = "/etc/kubernetes/cloud-config"

// Client reaches the host namespace that holds the guest cluster's VMs.
type Client struct {
	Namespace string
	Config    *rest.Config
	Kube      kubernetes.Interface
	KubeVirt  kubevirt.Interface
	Dynamic   dynamic.Interface
	// leanVMs and leanVMIs list and watch for the informers, decoding only
	// the fields the driver reads (lean.go); nil in a Client not built by
	// NewForConfig.
	leanVMs, leanVMIs rest.Interface
	// token serves a kubeconfig's bearer token read again when the file
	// changes; nil for other credentials.
	token *kubeconfigToken
}

// ResolveKubeconfig picks the host kubeconfig file as upstream does: the
// given path when it exists, else fallback (also when nothing was given).
// fellBack says the fallback was taken. The error names --kubeconfig, which
// is where an operator sets the path.
func ResolveKubeconfig(given, fallback string) (path string, fellBack bool, err error) {
	if given != "" {
		_, err := os.Stat(given)
		if err == nil {
			return given, false, nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return "", false, fmt.Errorf("host kubeconfig (--kubeconfig): %w", err)
		}
	}
	if _, err := os.Stat(fallback); err != nil {
		if given == "" {
			return "", false, fmt.Errorf("host kubeconfig: --kubeconfig not given and the default %s cannot be read: %w", fallback, err)
		}
		return "", false, fmt.Errorf("host kubeconfig: --kubeconfig %s does not exist and the fallback %s cannot be read: %w", given, fallback, err)
	}
	return fallback, true, nil
}

// Load reads the host kubeconfig at path (DefaultKubeconfig when path is
// empty or does not exist, see ResolveKubeconfig); the current context's
// namespace is the host namespace.
func Load(path string, qps float32, burst int) (*Client, error) {
	path, _, err := ResolveKubeconfig(path, DefaultKubeconfig)
	if err != nil {
		return nil, err
	}
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		&clientcmd.ClientConfigLoadingRules{ExplicitPath: path}, &clientcmd.ConfigOverrides{})
	cfg, err := loader.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("host kubeconfig %s: %w", path, err)
	}
	ns, _, err := loader.Namespace()
	if err != nil {
		return nil, fmt.Errorf("host kubeconfig %s: namespace: %w", path, err)
	}
	cfg.QPS, cfg.Burst = qps, burst
	tok, err := reloadToken(cfg, path)
	if err != nil {
		return nil, err
	}
	c, err := NewForConfig(cfg, ns)
	if err != nil {
		return nil, err
	}
	c.token = tok
	return c, nil
}

// TokenExpiry is when the host credentials' token expires, when the
// kubeconfig holds a token that says so; ok is false otherwise.
func (c *Client) TokenExpiry() (t time.Time, ok bool) {
	if c.token == nil {
		return time.Time{}, false
	}
	return c.token.Expiry()
}

// NewForConfig builds a Client for a namespace.
func NewForConfig(cfg *rest.Config, namespace string) (*Client, error) {
	if namespace == "" {
		return nil, errors.New("host namespace is empty")
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	kv, err := kubevirt.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	c := &Client{Namespace: namespace, Config: cfg, Kube: kube, KubeVirt: kv, Dynamic: dyn}
	if c.leanVMs, err = leanClient(cfg, leanVMs()); err != nil {
		return nil, err
	}
	if c.leanVMIs, err = leanClient(cfg, leanVMIs()); err != nil {
		return nil, err
	}
	return c, nil
}

// VMInformer watches the VMs of the host namespace. Its objects carry only
// the fields lean.go lists: nothing may write one back to the host.
func (c *Client) VMInformer(resync time.Duration) cache.SharedIndexInformer {
	if c.leanVMs != nil {
		return newInformer(&kubevirtv1.VirtualMachine{}, resync, leanListWatch(c.leanVMs, c.Namespace, "virtualmachines",
			func() runtime.Object { return &kubevirtv1.VirtualMachineList{} }))
	}
	// A Client assembled around fake clientsets, as unit tests do.
	vms := c.KubeVirt.KubevirtV1().VirtualMachines(c.Namespace)
	return newInformer(&kubevirtv1.VirtualMachine{}, resync, &cache.ListWatch{
		ListWithContextFunc:  func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return vms.List(ctx, o) },
		WatchFuncWithContext: vms.Watch,
	})
}

// VMIInformer watches the VMIs of the host namespace. Its objects carry only
// the fields lean.go lists: nothing may write one back to the host.
func (c *Client) VMIInformer(resync time.Duration) cache.SharedIndexInformer {
	if c.leanVMIs != nil {
		return newInformer(&kubevirtv1.VirtualMachineInstance{}, resync, leanListWatch(c.leanVMIs, c.Namespace, "virtualmachineinstances",
			func() runtime.Object { return &kubevirtv1.VirtualMachineInstanceList{} }))
	}
	vmis := c.KubeVirt.KubevirtV1().VirtualMachineInstances(c.Namespace)
	return newInformer(&kubevirtv1.VirtualMachineInstance{}, resync, &cache.ListWatch{
		ListWithContextFunc:  func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return vmis.List(ctx, o) },
		WatchFuncWithContext: vmis.Watch,
	})
}

func newInformer(obj runtime.Object, resync time.Duration, lw *cache.ListWatch) cache.SharedIndexInformer {
	inf := cache.NewSharedIndexInformer(lw, obj, resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	// The cache holds every VM and VMI of the namespace for the life of the
	// process: drop what no decision reads and what weighs most on a real
	// Harvester (server-side apply's managed fields, kubectl's copy of the
	// whole object in an annotation).
	_ = inf.SetTransform(trimObject)
	return inf
}

const lastApplied = "kubectl.kubernetes.io/last-applied-configuration"

func trimObject(obj any) (any, error) {
	if m, ok := obj.(metav1.Object); ok {
		m.SetManagedFields(nil)
		if a := m.GetAnnotations(); a[lastApplied] != "" {
			trimmed := make(map[string]string, len(a)-1)
			for k, v := range a {
				if k != lastApplied {
					trimmed[k] = v
				}
			}
			m.SetAnnotations(trimmed)
		}
	}
	return obj, nil
}
